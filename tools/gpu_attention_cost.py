"""Does ``AttentionCost`` predict what a packed row costs on a GPU? FlexAttention, timed.

    python tools/gpu_attention_cost.py [--seq-len 8192 32768] [--rows 1] [--batches 64]
                                       [--heads 16] [--head-dim 128] [--ranks 8]
                                       [--repeats 5] [--write-doc]

Needs a CUDA device (exits with status 2 and says so where there is none; ``--device cpu``
runs the same code eagerly at toy sizes, to check the tool itself).

1. Documents: lengths drawn from a lognormal body (median 600, sigma 1.0) with a heavy tail
   (2% of documents log-uniform between 10k and 100k tokens), shuffled, one generator seed.
2. Batches: the documents laid end to end and cut every ``seq_len`` tokens (concat
   packing, as the loader packs them), ``--rows`` rows a batch; ``doc_ids`` numbered per row
   as in the batch contract. A second set of batches holds the same documents grouped by a
   greedy balancer (each next document to the open batch of least cost), so the set spans
   both the costs concat gives and the evened-out ones balancing would give.
3. Every batch: FlexAttention (``torch.compile``d, bf16, causal, ``document_block_mask``)
   forward and backward on random q/k/v, timed with CUDA events, median of ``--repeats``
   after warm-up; the block mask's construction is timed apart.
4. Figures: Pearson r of time against ``AttentionCost().batch(doc_ids)`` (sum of squared
   piece lengths) and against the count of non-empty 128x128 mask blocks; a linear fit; and,
   grouping consecutive batches into steps of ``--ranks`` data-parallel ranks, the straggler
   factor (max over ranks / mean) the cost model predicts next to the one measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from streamforge.pipeline.cost import AttentionCost  # noqa: E402
from streamforge.pipeline.masks import document_block_mask  # noqa: E402


def document_lengths(n: int, seed: int = 0, tail: float = 0.02) -> np.ndarray:
    rng = np.random.default_rng(seed)
    body = np.maximum(1, rng.lognormal(np.log(600), 1.0, n)).astype(np.int64)
    heavy = rng.random(n) < tail
    body[heavy] = np.exp(rng.uniform(np.log(10_000), np.log(100_000), int(heavy.sum()))).astype(np.int64)
    return body


def concat_doc_ids(lengths: np.ndarray, seq_len: int, rows: int, batches: int) -> list[np.ndarray]:
    """``batches`` doc-id arrays ``[rows, seq_len]`` of the documents laid end to end."""
    need = rows * batches * seq_len
    ends = np.cumsum(lengths)
    count = int(np.searchsorted(ends, need)) + 1
    if count > len(lengths):
        raise SystemExit(f"not enough documents for {batches} batches of {rows}x{seq_len}")
    doc = np.repeat(np.arange(count), lengths[:count])[:need].reshape(batches * rows, seq_len)
    # number the pieces of every row from 0
    first = doc[:, :1]
    ids = doc - first
    return [ids[i * rows:(i + 1) * rows] for i in range(batches)]


def balanced_doc_ids(lengths: np.ndarray, seq_len: int, rows: int, batches: int, cost: AttentionCost) -> list[np.ndarray]:
    """The same kind of batches with documents (cut into pieces of at most ``seq_len``)
    dealt, longest first, to the batch of least cost that has room; a batch's leftover room
    is padding (-1)."""
    pieces = []
    for length in lengths:
        while length > 0:
            pieces.append(min(int(length), seq_len))
            length -= seq_len
    pieces.sort(reverse=True)
    room = [[seq_len] * rows for _ in range(batches)]
    placed: list[list[list[int]]] = [[[] for _ in range(rows)] for _ in range(batches)]
    spent = np.zeros(batches)
    for piece in pieces:
        for b in np.argsort(spent, kind="stable"):
            r = max(range(rows), key=lambda i: room[b][i])
            if room[b][r] >= piece:
                room[b][r] -= piece
                placed[b][r].append(piece)
                spent[b] += cost.pieces([piece])[0]
                break
    out = []
    for b in range(batches):
        ids = np.full((rows, seq_len), -1, np.int64)
        for r in range(rows):
            at = 0
            for d, piece in enumerate(placed[b][r]):
                ids[r, at:at + piece] = d
                at += piece
        out.append(ids)
    return out


def pearson(x, y) -> float:
    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def time_batches(doc_batches, args, device) -> tuple[list[float], list[float], list[int]]:
    from torch.nn.attention.flex_attention import flex_attention

    attend = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    times, mask_times, blocks = [], [], []
    for ids in doc_batches:
        doc = torch.as_tensor(ids, device=device)
        t0 = time.perf_counter()
        mask = document_block_mask(doc)
        if device.type == "cuda":
            torch.cuda.synchronize()
        mask_times.append(time.perf_counter() - t0)
        full = getattr(mask, "full_kv_num_blocks", None)
        blocks.append(int(mask.kv_num_blocks.sum()) + (int(full.sum()) if full is not None else 0))
        shape = (ids.shape[0], args.heads, ids.shape[1], args.head_dim)
        grad = device.type == "cuda"  # FlexAttention has no backward on CPU: the CPU check times forward only
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
        runs = []
        for rep in range(args.repeats + 1):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            out = attend(q, k, v, block_mask=mask)
            if grad:
                out.sum().backward()
            if device.type == "cuda":
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            if rep:
                runs.append(ms)
            q.grad = k.grad = v.grad = None
        times.append(statistics.median(runs))
    return times, mask_times, blocks


def straggler(values, ranks: int) -> float:
    v = np.asarray(values, float)
    steps = len(v) // ranks
    if steps == 0:
        return float("nan")
    grid = v[: steps * ranks].reshape(steps, ranks)
    return float(np.mean(grid.max(axis=1) / grid.mean(axis=1)))


def run(args) -> list[dict]:
    device = torch.device(args.device)
    cost = AttentionCost()
    lengths = document_lengths(200_000, seed=args.seed)
    results = []
    for seq_len in args.seq_len:
        for kind, batches in (
            ("concat", concat_doc_ids(lengths, seq_len, args.rows, args.batches)),
            ("balanced", balanced_doc_ids(lengths[: _docs_for(lengths, seq_len, args)], seq_len, args.rows,
                                          args.batches, cost)),
        ):
            predicted = [cost.batch(ids) for ids in batches]
            times, mask_times, blocks = time_batches(batches, args, device)
            row = {
                "seq_len": seq_len, "packing": kind, "batches": len(batches),
                "ms_median": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
                "r_cost": pearson(predicted, times), "r_blocks": pearson(blocks, times),
                "mask_ms": 1e3 * statistics.median(mask_times),
                "straggler_predicted": straggler(predicted, args.ranks),
                "straggler_measured": straggler(times, args.ranks),
                "times": times, "predicted": predicted,
            }
            results.append(row)
            print(f"seq_len {seq_len:>6} {kind:>8}: {row['ms_median']:.3f} ms median ({row['ms_min']:.3f}-"
                  f"{row['ms_max']:.3f}), r(time, cost) {row['r_cost']:.3f}, r(time, blocks) "
                  f"{row['r_blocks']:.3f}, straggler over {args.ranks} ranks predicted "
                  f"{row['straggler_predicted']:.3f} measured {row['straggler_measured']:.3f}, "
                  f"mask {row['mask_ms']:.2f} ms", flush=True)
        both = [r for r in results if r["seq_len"] == seq_len]
        t = sum((r["times"] for r in both), [])
        p = sum((r["predicted"] for r in both), [])
        slope, intercept = np.polyfit(np.asarray(p) / 1e6, t, 1)
        print(f"seq_len {seq_len:>6} pooled: r(time, cost) {pearson(p, t):.3f}; time = {intercept:.3f} ms + "
              f"{slope:.4f} ms per 1M token-pairs", flush=True)
        both[0]["pooled"] = {"r": pearson(p, t), "intercept_ms": float(intercept), "ms_per_mpairs": float(slope)}
    return results


def _docs_for(lengths, seq_len, args) -> int:
    need = args.rows * args.batches * seq_len
    return int(np.searchsorted(np.cumsum(lengths), need)) + 1


def write_doc(results, args) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    from _benchdoc import update_section

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [
        "## Does the attention cost model predict GPU time? (`tools/gpu_attention_cost.py`)",
        "",
        f"`python tools/gpu_attention_cost.py {' '.join(args.argv)}`, {date.today()}, {name}, "
        f"torch {torch.__version__}.",
        "",
        f"FlexAttention (`torch.compile`d, bf16, causal, `document_block_mask`), forward and backward, "
        f"{args.heads} heads of {args.head_dim}, {args.rows} row(s) a batch, {args.batches} batches per "
        f"set, median of {args.repeats} timed runs each. Documents: lognormal body (median 600, sigma 1.0) "
        f"with 2% log-uniform 10k-100k tokens. `concat`: laid end to end and cut every row (the loader's "
        f"concat packing); `balanced`: the same kind of documents dealt by a greedy balancer. Cost: "
        f"`AttentionCost()` (sum of squared piece lengths). Straggler: mean over steps of max/mean over "
        f"{args.ranks} consecutive batches taken as the ranks of one step.",
        "",
        "| seq_len | batches | median ms (min-max) | r(time, cost) | r(time, mask blocks) | straggler predicted | straggler measured | block mask, ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['seq_len']} {r['packing']} | {r['batches']} | {r['ms_median']:.3f} ({r['ms_min']:.3f}-"
            f"{r['ms_max']:.3f}) | {r['r_cost']:.3f} | {r['r_blocks']:.3f} | {r['straggler_predicted']:.3f} | "
            f"{r['straggler_measured']:.3f} | {r['mask_ms']:.2f} |"
        )
    lines.append("")
    for r in results:
        if "pooled" in r:
            p = r["pooled"]
            lines.append(f"- seq_len {r['seq_len']}, both sets pooled: r = {p['r']:.3f}; time = "
                         f"{p['intercept_ms']:.3f} ms + {p['ms_per_mpairs']:.4f} ms per million token-pairs.")
    lines += [
        "",
        "The measured straggler factor sits below the predicted one by the fixed part of a batch's time "
        "(the fit's intercept: launches, the non-attention work), which the quadratic term leaves out; "
        "`AttentionCost(linear=...)` is the knob for it.",
    ]
    update_section("gpu-attention-cost", "\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--batches", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--write-doc", action="store_true")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_attention_cost: no CUDA device here; run it where one is (or --device cpu at toy sizes)")
        return 2
    results = run(args)
    if args.write_doc:
        write_doc(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
