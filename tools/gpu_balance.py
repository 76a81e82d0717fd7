"""Balanced packing on a GPU: does ``packing="balance"`` even out the ranks' attention time?

    python tools/gpu_balance.py [--seq-len 8192] [--ranks 8] [--steps 24] [--batch 1 4]
                                [--heads 16] [--head-dim 128] [--repeats 5] [--write-doc]

Needs a CUDA device (exits with status 2 and says so where there is none; ``--device cpu``
runs the same code eagerly at toy sizes, to check the tool itself).

Each of ``--ranks`` data-parallel ranks gets a stream of its own documents (the length
distribution of ``tools/bench_balance.py``: lognormal body, median 600, and 2% of 10k-100k
tokens), and builds ``--steps`` batches of ``--batch`` rows from it twice: with concat packing
(the documents laid end to end and cut every ``seq_len``) and with the real balanced packer
(``BalancedPacker`` over the same lengths, aiming at the target ``balance_target`` derives
from a sample of the distribution). Every batch is timed on the one GPU as its rank would run
it: FlexAttention (``torch.compile``d, bf16, causal, ``document_block_mask``) forward and
backward, median of ``--repeats``. A step takes as long as its slowest rank, so the figures
are, per packing: the measured straggler factor (max over ranks of a step's time over the
mean, averaged over steps), the one the cost model predicts, the mean step time (the slowest
rank's), the attention work done, and Pearson r of time against ``AttentionCost``'s cost
over every batch of both packings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from datetime import date
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from bench_balance import LengthSource, document_lengths  # noqa: E402
from gpu_attention_cost import pearson, time_batches  # noqa: E402
from streamforge.pipeline.cost import AttentionCost  # noqa: E402
from streamforge.stages.balance import WINDOW_ROWS, BalancedPacker  # noqa: E402
from streamforge.stages.layout_balance import balance_target  # noqa: E402


def concat_batches(lengths: np.ndarray, seq_len: int, batch: int, steps: int) -> list[np.ndarray]:
    """``steps`` doc-id arrays ``[batch, seq_len]`` of ``lengths`` laid end to end."""
    need = steps * batch * seq_len
    ends = np.cumsum(lengths)
    if ends[-1] < need:
        raise SystemExit("not enough documents for the concat batches")
    doc = np.searchsorted(ends, np.arange(need), side="right")  # the document of every position
    rows = doc.reshape(steps, batch, seq_len)
    return [np.asarray(r - r[:, :1], np.int64) for r in rows]  # numbered from 0 in each row


def balanced_batches(lengths: np.ndarray, seq_len: int, batch: int, steps: int, target: float) -> list[np.ndarray]:
    """``steps`` doc-id arrays from the balanced packer's rows: each piece its own id."""
    packer = BalancedPacker(LengthSource(lengths), seq_len=seq_len, target=target)
    out = []
    for s in range(steps):
        rows = packer.next_rows(batch)
        if rows is None or rows.num_rows < batch:
            raise SystemExit(f"the balanced packer ran out of documents at step {s}")
        ids = np.full(batch * seq_len, -1, np.int64)
        for i, (a, n) in enumerate(zip(np.asarray(rows.start).tolist(), np.asarray(rows.length).tolist())):
            ids[a:a + n] = i
        out.append(ids.reshape(batch, seq_len))
    return out


def run(args) -> list[dict]:
    device = torch.device(args.device)
    model = AttentionCost()
    sample = document_lengths(200_000, seed=10**6)
    results = []
    for seq_len in args.seq_len:
        target = balance_target([sample], [1.0], seq_len, WINDOW_ROWS)
        for batch in args.batch:
            need = (args.steps + WINDOW_ROWS + 2) * batch * seq_len
            docs = int(need / 1200 * 1.3) + 1000
            pooled_t, pooled_c, rows = [], [], {}
            for kind in ("concat", "balance"):
                times, costs = [], []
                for r in range(args.ranks):
                    lengths = document_lengths(docs, seed=r)
                    made = (concat_batches(lengths, seq_len, batch, args.steps) if kind == "concat"
                            else balanced_batches(lengths, seq_len, batch, args.steps, target))
                    t, _, _ = time_batches(made, args, device)
                    times.append(t)
                    costs.append([model.batch(ids) for ids in made])
                t, c = np.array(times), np.array(costs)  # [rank, step]
                pooled_t += t.ravel().tolist()
                pooled_c += c.ravel().tolist()
                rows[kind] = {
                    "seq_len": seq_len, "batch": batch, "packing": kind,
                    "straggler_measured": float((t.max(0) / t.mean(0)).mean()),
                    "straggler_predicted": float((c.max(0) / c.mean(0)).mean()),
                    "step_ms": float(t.max(0).mean()), "rank_ms": float(t.mean()),
                    "waiting": float((t.max(0) - t.mean(0)).sum() / t.max(0).sum()),
                    "work": float(c.sum()),
                }
            r_all = pearson(pooled_c, pooled_t)
            for kind in ("concat", "balance"):
                row = rows[kind]
                row["r_cost"] = r_all
                row["work_vs_concat"] = row["work"] / rows["concat"]["work"]
                row["step_vs_concat"] = row["step_ms"] / rows["concat"]["step_ms"]
                results.append(row)
                print(f"seq_len {seq_len} batch {batch} {kind:>7}: straggler measured {row['straggler_measured']:.3f} "
                      f"(predicted {row['straggler_predicted']:.3f}), step {row['step_ms']:.3f} ms (slowest rank), "
                      f"rank mean {row['rank_ms']:.3f} ms, time waiting {row['waiting']:.1%}, attention work "
                      f"{row['work_vs_concat']:.2f}x concat's, r(time, cost) {r_all:.3f}", flush=True)
    return results


def write_doc(results, args) -> None:
    from _benchdoc import update_section

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [
        "## Balanced packing on a GPU (`tools/gpu_balance.py`)",
        "",
        f"`python tools/gpu_balance.py {' '.join(args.argv)}`, {date.today()}, {name}, torch {torch.__version__}.",
        "",
        f"{args.ranks} ranks, each with documents of its own (lognormal body, median 600, sigma 1.0, and 2% of "
        f"10k-100k tokens), {args.steps} steps; each rank's batches built by concat packing and by the real "
        f"balanced packer from the same lengths, and timed on the GPU: FlexAttention (`torch.compile`d, bf16, "
        f"causal, `document_block_mask`), forward and backward, {args.heads} heads of {args.head_dim}, median "
        f"of {args.repeats}. Straggler: max over ranks of a step's time over the mean, averaged over steps; "
        f"step: the slowest rank's time; waiting: the share of the ranks' time spent waiting for the slowest; "
        f"work: the summed attention cost (sum of squared piece lengths) against concat's.",
        "",
        "| seq_len | rows/rank | packing | straggler measured | predicted | step ms (slowest rank) | rank mean ms | waiting | work vs concat | step vs concat | r(time, cost), both |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['seq_len']} | {r['batch']} | {r['packing']} | {r['straggler_measured']:.3f} | "
                     f"{r['straggler_predicted']:.3f} | {r['step_ms']:.3f} | {r['rank_ms']:.3f} | {r['waiting']:.1%} | "
                     f"{r['work_vs_concat']:.2f} | {r['step_vs_concat']:.2f} | {r['r_cost']:.3f} |")
    lines += [
        "",
        "Balanced rows cut long documents at the piece cap (docs/design.md), so part of the lower step time is "
        "attention work not done at all (the work column), not waiting removed: the straggler and waiting "
        "columns are the balancing itself.",
    ]
    update_section("gpu-balance", "\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[8192])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_balance: no CUDA device here; run it where there is one (or --device cpu at toy sizes to "
              "check the tool)", file=sys.stderr)
        return 2
    results = run(args)
    if args.write_doc:
        write_doc(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
