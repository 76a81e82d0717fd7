"""Straggling between data-parallel ranks: concat, bestfit and balanced packing, without a GPU.

    python tools/bench_balance.py [--seq-len 2048 8192 32768] [--ranks 8 64 512]
                                  [--steps 100] [--batch-size 1] [--loader-steps 40]
                                  [--no-write]

What it runs:

1. Documents: lengths drawn from a lognormal body (median 600, sigma 1.0) with a heavy tail
   (2% of documents log-uniform between 10k and 100k tokens; the corpus of
   ``tools/gpu_attention_cost.py``), one independent stream of lengths per rank (its seed is
   the rank's), plus one more for the target's sample.
2. Packing: for each rank, the real packer stages (``stages.pack.Packer`` in ``bestfit`` mode,
   ``stages.balance.BalancedPacker``) pull from a ``LengthSource``, a stand-in for the
   interleaver that hands out the rank's documents (zero tokens, real lengths) through the
   interleaver's calls (``take``, ``take_run``, ``peek_token``, ``state_dict``). concat
   packing is the lengths laid end to end and cut every ``seq_len`` tokens (what
   ``Packer(mode="concat")`` does; the real loader check below confirms it). The balanced
   packer's target comes from ``layout_balance.balance_target`` on 200,000 sampled lengths,
   as ``stages.balance.corpus_target`` computes it from a corpus's record indexes.
3. Every batch (``--batch-size`` rows a rank and step): its cost from the packer's output
   pieces (``pipeline.cost.piece_row_costs``: ``sum(L ** 2)`` over each row's pieces, what
   ``AttentionCost().batch(doc_ids)`` gives); bestfit's first rows are skipped, a random number
   up to two windows' (a window hands out its long documents' full rows first, so every rank
   would start in step otherwise). Per step: the straggler factor, max over the
   ranks of the batch cost over their mean; over the ``--steps`` steps: its mean and 99th
   percentile, and the wasted share, sum over steps of (max - mean) over sum of max (the
   attention work the other ranks spend waiting for the slowest). Padding: padded tokens over
   all row tokens. Work: the total cost over concat's (cutting documents lowers it).
4. The real loader (``--loader-steps``, 0 to skip): a corpus of the same distribution written
   with ``ShardWriter`` (enough tokens for 8 ranks), read by ``StreamingLoader`` on each of 8
   ranks at seq_len 8192 in concat and balance packing; the costs from each batch's
   ``doc_ids`` (``AttentionCost``) give the same figures, printed beside the synthetic ones.

Prints a table and writes the ``balance`` section of docs/benchmarks.md (and
``docs/img/balance.png``) unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from streamforge.pipeline.cost import piece_row_costs  # noqa: E402
from streamforge.stages.balance import WINDOW_ROWS, BalancedPacker  # noqa: E402
from streamforge.stages.layout_balance import balance_target  # noqa: E402
from streamforge.stages.pack import Packer  # noqa: E402
from streamforge.stages.runs import DocRun  # noqa: E402

MODES = ("concat", "bestfit", "balance")
BESTFIT_ROWS = 0  # set per seq_len: about the rows of one bestfit window (512 documents)
TAIL = 0.02


def document_lengths(n: int, seed: int) -> np.ndarray:
    """``n`` lengths: lognormal body (median 600, sigma 1) and 2% log-uniform 10k-100k."""
    rng = np.random.default_rng(seed)
    body = np.maximum(1, rng.lognormal(np.log(600), 1.0, n)).astype(np.int64)
    heavy = rng.random(n) < TAIL
    body[heavy] = np.exp(rng.uniform(np.log(10_000), np.log(100_000), int(heavy.sum()))).astype(np.int64)
    return body


class LengthSource:
    """The interleaver's calls over a list of document lengths, with zero tokens."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths
        self.ends = np.cumsum(lengths)
        self.doc, self.offset = 0, 0
        self.zeros = np.zeros(int(lengths.max()) + 1, np.uint16)

    def state_dict(self) -> dict:
        return {"doc": self.doc, "offset": self.offset}

    def take(self, n: int):
        if self.doc >= len(self.lengths):
            return None
        length = int(self.lengths[self.doc])
        k = min(n, length - self.offset)
        got = (0, self.zeros[:k], 0, self.doc, self.offset, self.offset + k == length)
        self.offset += k
        if self.offset == length:
            self.doc, self.offset = self.doc + 1, 0
        return got

    def take_run(self, n: int):
        if self.doc >= len(self.lengths):
            return None
        at = (self.ends[self.doc - 1] if self.doc else 0) + self.offset
        last = min(int(np.searchsorted(self.ends, at + n, side="left")), len(self.lengths) - 1)
        stop = min(at + n, int(self.ends[last]))
        docs = np.arange(self.doc, last + 1)
        starts = np.maximum(self.ends[docs] - self.lengths[docs], at)
        length = np.minimum(self.ends[docs], stop) - starts
        token_start = starts - (self.ends[docs] - self.lengths[docs])
        done = stop == int(self.ends[last])
        size = int(stop - at)
        self.doc, self.offset = (last + 1, 0) if done else (last, int(stop - (self.ends[last] - self.lengths[last])))
        run = DocRun(parts=[np.zeros(size, np.uint16)], size=size, shard=np.zeros(len(docs), np.int64),
                     record=docs.astype(np.int64), token_start=token_start.astype(np.int64),
                     length=length.astype(np.int64), done=bool(done))
        return 0, run

    def peek_token(self):
        return None if self.doc >= len(self.lengths) else 1

    def close(self) -> None:
        pass


def concat_costs(lengths: np.ndarray, seq_len: int, rows: int) -> tuple[np.ndarray, int]:
    """Row costs of the lengths laid end to end and cut every ``seq_len`` tokens."""
    ends = np.cumsum(lengths)
    cuts = np.arange(1, rows + 1) * seq_len
    bounds = np.union1d(np.concatenate([[0], ends[ends < cuts[-1]]]), cuts)
    seg = np.diff(bounds).astype(np.float64)
    row = bounds[:-1] // seq_len
    return np.bincount(row, weights=seg * seg, minlength=rows)[:rows], 0


def packer_costs(packer, seq_len: int, steps: int, batch: int) -> tuple[np.ndarray, int]:
    """Per-step batch costs from a real packer stage, and the padded tokens."""
    out, padded = np.zeros(steps), 0
    for s in range(steps):
        rows = packer.next_rows(batch)
        if rows is None or rows.num_rows < batch:
            raise SystemExit(f"the length stream ran out at step {s}: more documents are needed")
        out[s] = piece_row_costs(rows.start, rows.length, seq_len, rows.num_rows).sum()
        padded += rows.num_rows * seq_len - int(rows.length.sum())
    return out, padded


def rank_costs(mode: str, lengths: np.ndarray, seq_len: int, steps: int, batch: int, target: float):
    if mode == "concat":
        rows, padded = concat_costs(lengths, seq_len, steps * batch)
        return rows.reshape(steps, batch).sum(1), padded
    source = LengthSource(lengths)
    if mode == "bestfit":
        packer = Packer(source, seq_len=seq_len, mode="bestfit")
        # a bestfit window hands out its long documents' full rows first: each rank starts
        # at its own point of a window (as ranks do once a pass is under way)
        skip = int(np.random.default_rng(len(lengths) + int(lengths[0])).integers(0, BESTFIT_ROWS * 2))
        for _ in range(skip):
            packer.next_rows(1)
    else:
        packer = BalancedPacker(source, seq_len=seq_len, target=target)
    return packer_costs(packer, seq_len, steps, batch)


def figures(costs: np.ndarray) -> dict:
    """``costs[rank, step]``: straggler mean and p99, wasted share."""
    top, mean = costs.max(0), costs.mean(0)
    factor = top / mean
    return {"mean": float(factor.mean()), "p99": float(np.percentile(factor, 99)),
            "wasted": float((top - mean).sum() / top.sum()), "work": float(costs.sum())}


def synthetic(seq_lens, ranks, steps, batch) -> list[dict]:
    sample = document_lengths(200_000, seed=10**6)
    out = []
    for T in seq_lens:
        target = balance_target([sample], [1.0], T, WINDOW_ROWS)
        global BESTFIT_ROWS
        BESTFIT_ROWS = int(512 * sample.mean() / T) + 1
        need = steps * batch * T + (WINDOW_ROWS + 2 + 2 * BESTFIT_ROWS) * T
        docs = int(need / 1200 * 1.3) + 1000  # mean length ~1,400: a margin of documents
        for R in ranks:
            t0 = time.perf_counter()
            got = {}
            for mode in MODES:
                costs, padded = [], 0
                for r in range(R):
                    lengths = document_lengths(docs, seed=r)
                    c, p = rank_costs(mode, lengths, T, steps, batch, target)
                    costs.append(c)
                    padded += p
                got[mode] = figures(np.array(costs))
                got[mode]["padding"] = padded / (R * steps * batch * T)
            row = {"seq_len": T, "ranks": R, "target": target, "modes": got, "seconds": time.perf_counter() - t0}
            out.append(row)
            print(line(row), flush=True)
    return out


def line(row: dict) -> str:
    m = row["modes"]
    cut = m["concat"]["wasted"] / max(m["balance"]["wasted"], 1e-12)
    return (f"| {row['seq_len']} | {row['ranks']} | " + " | ".join(
        f"{m[k]['mean']:.3f} / {m[k]['p99']:.3f}" for k in MODES) + " | " + " | ".join(
        f"{m[k]['wasted']:.1%}" for k in MODES) + f" | {cut:.1f}x | {m['bestfit']['padding']:.2%} / "
        f"{m['balance']['padding']:.2%} | {m['balance']['work'] / m['concat']['work']:.2f} |")


HEADER = ("| seq_len | ranks | straggler concat mean / p99 | bestfit | balance | wasted concat | bestfit | "
          "balance | wasted cut (concat / balance) | padding bestfit / balance | work balance / concat |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def real_loader(steps: int, batch: int, seq_len: int = 8192, world: int = 8) -> dict:
    """The same figures from ``StreamingLoader`` over a written corpus, 8 ranks (0 workers)."""
    from streamforge import AttentionCost, PackedTokenDataset, ShardWriter, StreamingLoader

    need = int((steps + WINDOW_ROWS) * batch * seq_len * world * 1.15)
    lengths = document_lengths(need // 1000, seed=7)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), need)) + 1]
    root = tempfile.mkdtemp(prefix="bench-balance-")
    rng = np.random.default_rng(0)
    with ShardWriter(os.path.join(root, "s"), shard_size="8MiB", eos_id=0) as writer:
        for n in lengths:
            writer.write(rng.integers(1, 30000, int(n), dtype=np.uint16))
    out = {}
    model = AttentionCost()
    for mode in ("concat", "balance"):
        costs = []
        for rank in range(world):
            ds = PackedTokenDataset(os.path.join(root, "s"), seq_len=seq_len, packing=mode, rank=rank,
                                    world_size=world)
            loader = StreamingLoader(ds, batch_size=batch)
            got = []
            for i, b in zip(range(steps), loader):
                got.append(model.batch(b["doc_ids"]))
            costs.append(got)
        n = min(len(c) for c in costs)
        out[mode] = figures(np.array([c[:n] for c in costs]))
        out[mode]["steps"] = n
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _benchdoc import save_figure

    fig, ax = plt.subplots(figsize=(8, 3.6))
    labels = [f"{r['seq_len']}\nR={r['ranks']}" for r in rows]
    x = np.arange(len(rows))
    for i, mode in enumerate(MODES):
        ax.bar(x + (i - 1) * 0.27, [r["modes"][mode]["mean"] for r in rows], 0.27, label=mode)
    ax.axhline(1.05, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("mean straggler factor (max / mean)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--loader-steps", type=int, default=40)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    print(HEADER)
    rows = synthetic(args.seq_len, args.ranks, args.steps, args.batch_size)
    real = real_loader(args.loader_steps, args.batch_size) if args.loader_steps else None
    synth8 = next((r for r in rows if r["seq_len"] == 8192 and r["ranks"] == 8), None)
    check = []
    if real:
        for mode in ("concat", "balance"):
            s = synth8["modes"][mode] if synth8 else None
            check.append(f"| {mode} | {real[mode]['mean']:.3f} / {real[mode]['p99']:.3f} | {real[mode]['wasted']:.1%} | "
                         + (f"{s['mean']:.3f} / {s['p99']:.3f} | {s['wasted']:.1%} |" if s else "- | - |"))
        print("\n".join(check))
    command = ("python tools/bench_balance.py --seq-len " + " ".join(map(str, args.seq_len)) + " --ranks "
               + " ".join(map(str, args.ranks)) + f" --steps {args.steps} --batch-size {args.batch_size} "
               f"--loader-steps {args.loader_steps}")
    text = "\n".join([
        "## Straggling between ranks: concat, bestfit and balanced packing (`tools/bench_balance.py`)", "",
        f"`{command}`, {datetime.date.today()}, {platform.machine()} with {os.cpu_count()} CPUs, no GPU. "
        "Documents: lognormal body (median 600, sigma 1.0) with 2% log-uniform 10k-100k tokens, one "
        f"independent stream per rank; {args.batch_size} row(s) per rank and step, {args.steps} steps. bestfit "
        "and balance: the real packer stages driven by each rank's lengths (tools/bench_balance.py says how); "
        "concat: the lengths cut every seq_len. Straggler: max over ranks of the step's batch cost "
        "(sum of squared piece lengths) over their mean, mean / p99 over the steps; wasted: sum of (max - mean) "
        "over sum of max; work: total cost over concat's.", "",
        HEADER, *[line(r) for r in rows], "",
        *([f"The real loader (`StreamingLoader`, 8 ranks, seq_len 8192, {real['concat']['steps']} steps, costs "
           "from each batch's `doc_ids`) next to the synthetic figures of the same setting:", "",
           "| packing | loader straggler mean / p99 | loader wasted | synthetic mean / p99 | synthetic wasted |",
           "|---|---|---|---|---|", *check, ""] if real else []),
        "![straggler factor by seq_len and ranks](img/balance.png)",
    ])
    if not args.no_write:
        from _benchdoc import publish
        publish("balance", text, os.path.join(ROOT, "docs", "benchmarks.md"), lambda path: plot(rows, path),
                "balance.png")


if __name__ == "__main__":
    main()
