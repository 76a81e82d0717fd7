"""Realized token shares per schedule phase, from a real run: the plot in docs/mixing.md.

    python tools/plot_mixing.py [--steps 600] [--workers 2] [--no-write]

Builds a three-stream synthetic corpus (web, code, books: lognormal document lengths with
medians 300, 900 and 3000 tokens) under ``bench-out/mixing/``, streams it through
``StreamingLoader`` (seq_len 1024, batch 8, ``infinite=True``) with a three-phase schedule,
and records every batch's tokens per stream. Writes ``docs/img/mixing_phases.png`` (share
of each stream per step, smoothed, and the share within the phase so far, against the
phase's weights) and the ``stats()`` table into the ``run`` section of docs/mixing.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from _benchdoc import save_figure, update_section  # noqa: E402
from streamforge import PackedTokenDataset, ShardWriter, Stream, StreamingLoader  # noqa: E402

EOS = 50256
STREAMS = (("web", 300, 40_000), ("code", 900, 12_000), ("books", 3000, 3_000))
SEQ_LEN, BATCH = 1024, 8


def schedule(steps: int) -> list:
    a, b = steps // 3, 2 * steps // 3
    return [
        (0, {"web": 0.6, "code": 0.3, "books": 0.1}),
        (a, {"web": 0.3, "code": 0.5, "books": 0.2}),
        (b, {"web": 0.1, "code": 0.1, "books": 0.8}),
    ]


def build_corpus(root: str) -> list[Stream]:
    rng = np.random.default_rng(0)
    streams = []
    for name, median, count in STREAMS:
        url = os.path.join(root, name)
        if not os.path.exists(os.path.join(url, "index.json")):
            lengths = np.maximum(1, rng.lognormal(np.log(median), 0.8, count).astype(np.int64))
            with ShardWriter(url, shard_size="8MiB", eos_id=EOS) as writer:
                for n in tqdm(lengths, desc=f"corpus {name}", unit="doc", leave=False):
                    writer.write(rng.integers(0, EOS, int(n), dtype=np.uint16))
        streams.append(Stream(url, name=name))
    return streams


def run(streams, steps: int, workers: int):
    ds = PackedTokenDataset(streams, seq_len=SEQ_LEN, seed=0, infinite=True, weights=schedule(steps))
    loader = StreamingLoader(ds, batch_size=BATCH, num_workers=workers)
    per_step = np.zeros((steps, len(streams)), np.int64)
    bar = tqdm(total=steps, unit="step", desc="streaming")
    for i, batch in enumerate(loader):
        ids = batch["source_ids"].numpy().ravel()
        per_step[i] = np.bincount(ids[ids >= 0], minlength=len(streams))
        bar.update(1)
        if i + 1 == steps:
            break
    bar.close()
    return per_step, loader.stats()


def plot(per_step: np.ndarray, phases: list, names: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = len(per_step)
    starts = [p[0] for p in phases] + [steps]
    fig, axes = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    window = 9
    kernel = np.ones(window) / window
    totals = per_step.sum(axis=1)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(names):
        share = np.convolve(per_step[:, i], kernel, "same") / np.maximum(np.convolve(totals, kernel, "same"), 1)
        axes[0].plot(share, color=colors[i], label=name, linewidth=1)
        cum = np.zeros(steps)
        for p in range(len(phases)):
            lo, hi = starts[p], starts[p + 1]
            seg = np.cumsum(per_step[lo:hi], axis=0)
            cum[lo:hi] = seg[:, i] / np.maximum(seg.sum(axis=1), 1)
            for ax in axes:
                ax.hlines(phases[p][1][name], lo, hi, colors=colors[i], linestyles="--", linewidth=0.8)
        axes[1].plot(cum, color=colors[i], label=name, linewidth=1.2)
    for ax in axes:
        for s in starts[1:-1]:
            ax.axvline(s, color="grey", linewidth=0.8)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel(f"share per step\n({window}-step mean)")
    axes[1].set_ylabel("share within the\nphase so far")
    axes[1].set_xlabel("global step")
    axes[0].set_title("realized token shares vs the schedule's weights (dashed); phase switches in grey")
    axes[0].legend(loc="upper left", fontsize="small")
    save_figure(fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    streams = build_corpus(os.path.join(ROOT, "bench-out", "mixing"))
    names = [s.name for s in streams]
    per_step, stats = run(streams, args.steps, args.workers)
    rows = []
    for phase in stats["phases"]:
        cells = " | ".join(f"{phase['weights'][n]:.2f} / {phase['shares'][n]:.3f}" for n in names)
        rows.append(f"| {phase['phase']} | {phase['first_step']} | {cells} |")
    text = "\n".join([
        "### Measured",
        "",
        f"`python tools/plot_mixing.py --steps {args.steps} --workers {args.workers}`, {datetime.date.today()}: "
        f"three synthetic streams (document medians {', '.join(f'{n} {m}' for n, m, _ in STREAMS)} tokens), "
        f"seq_len {SEQ_LEN}, batch {BATCH}, {args.workers} workers; `stats()` after {args.steps} steps.",
        "",
        "![realized shares per phase](img/mixing_phases.png)",
        "",
        "| phase | first step | " + " | ".join(f"{n}: weight / realized" for n in names) + " |",
        "|---|---|" + "---|" * len(names),
        *rows,
    ])
    print(text)
    if not args.no_write:
        plot(per_step, schedule(args.steps), names, os.path.join(ROOT, "docs", "img", "mixing_phases.png"))
        update_section("run", text, path=os.path.join(ROOT, "docs", "mixing.md"))


if __name__ == "__main__":
    main()
