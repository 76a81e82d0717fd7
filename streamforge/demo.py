"""``streamforge demo``: build a small three-stream corpus, stream packed blocks, resume exactly.

The demo runs the whole path on data it makes itself, so it needs no bucket and no download:

1. Corpus (``./demo-out/``, 8M tokens by default; about 2 s on one core, reused by the next
   run with the same parameters). Three streams of synthetic tokenized documents over a
   50,257-token vocabulary (ids 0..50255, EOS 50256), written with ``ShardWriter`` into
   several shards each:

   ======  ===============================  ==============
   stream  document length (tokens)         share / weight
   ======  ===============================  ==============
   web     lognormal, median ~600           60% / 0.6
   code    lognormal, median ~1,800         30% / 0.3
   books   lognormal, median ~30,000        10% / 0.1
   ======  ===============================  ==============

   Token ids follow a Zipf-like law, as tokenized text roughly does.
2. Stream: ``PackedTokenDataset`` (concat packing, seq_len 2048, seeded shuffle) driven by a
   ``StreamingLoader`` for one pass, with a progress bar; then a summary of throughput and
   of the realized mixture.
3. Exact resume: the loader state saved after batch ``--resume-at`` (as JSON, in the output
   directory) is loaded into a fresh loader, whose next batches must equal the uninterrupted
   run's bit for bit.

Run it as ``streamforge demo`` or ``python -m streamforge.demo``; ``--help`` lists options.
Measured on one core: the default run takes a few seconds, most of them building the corpus;
streaming runs at tens of millions of tokens/s from local disk in one process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .errors import ManifestError
from .format.manifest import Manifest
from .format.writer import ShardWriter, parse_size

VOCAB_SIZE = 50257
EOS_ID = 50256
DEFAULT_TOKENS = 8_000_000


@dataclass(frozen=True)
class StreamSpec:
    """How one synthetic stream is made: its share of the corpus and its document lengths."""

    name: str
    weight: float
    median_len: int
    sigma: float  # of log(length)
    meta: bool  # write a small .json member per document


STREAMS = (
    StreamSpec("web", 0.6, 600, 1.0, meta=True),
    StreamSpec("code", 0.3, 1800, 0.9, meta=False),
    StreamSpec("books", 0.1, 30000, 0.5, meta=False),
)


# -- corpus ------------------------------------------------------------------------------------
def zipf_table(vocab: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(cdf over ranks, rank -> token id) for a Zipf-like unigram law over ``vocab`` ids."""
    weights = 1.0 / (np.arange(vocab, dtype=np.float64) + 2.7)
    cdf = np.cumsum(weights)
    return cdf / cdf[-1], rng.permutation(vocab).astype(np.uint16)


def document_lengths(spec: StreamSpec, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Lognormal lengths (at least 1) whose sum just reaches ``num_tokens``."""
    mean = spec.median_len * math.exp(spec.sigma**2 / 2)
    lengths = np.zeros(0, np.int64)
    while lengths.sum() < num_tokens:
        more = int(2 * (num_tokens - lengths.sum()) / mean) + 8
        drawn = rng.lognormal(math.log(spec.median_len), spec.sigma, size=more)
        lengths = np.concatenate([lengths, np.maximum(drawn, 1).astype(np.int64)])
    count = int(np.searchsorted(np.cumsum(lengths), num_tokens)) + 1
    return lengths[:count]


def build_stream(spec: StreamSpec, url: str, num_tokens: int, seed: int) -> Manifest:
    """Write one synthetic stream; an existing one made with the same parameters is reused."""
    fingerprint = f"streamforge-demo:{spec.name}:{num_tokens}:{seed}"
    try:
        existing = Manifest.load(url)
        if existing.source_fingerprint == fingerprint:
            return existing
    except ManifestError:
        pass
    rng = np.random.default_rng([seed, STREAMS.index(spec)])
    lengths = document_lengths(spec, num_tokens, rng)
    cdf, token_of_rank = zipf_table(EOS_ID, rng)
    tokens = token_of_rank[np.searchsorted(cdf, rng.random(int(lengths.sum())))]
    stream_bytes = int(lengths.sum()) * 2
    shard_size = max(16 << 10, stream_bytes // 6)  # about six shards a stream
    frame_size = min(256 << 10, max(4 << 10, shard_size // 8))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    with ShardWriter(
        url, token_dtype="uint16", shard_size=shard_size, frame_size=frame_size,
        eos_id=EOS_ID, vocab_size=VOCAB_SIZE, source_fingerprint=fingerprint, overwrite=True,
        conversion={"source": "streamforge demo (synthetic)", "stream": spec.name},
    ) as writer:
        for i in range(len(lengths)):
            meta = {"url": f"https://example.com/{spec.name}/{i}"} if spec.meta else None
            writer.write(tokens[bounds[i] : bounds[i + 1]], meta=meta)
    return writer.close()


def build_corpus(out_dir: Path, num_tokens: int, seed: int) -> dict[str, Manifest]:
    """The demo's streams under ``out_dir``, by name."""
    return {
        spec.name: build_stream(spec, str(out_dir / spec.name), int(num_tokens * spec.weight), seed)
        for spec in STREAMS
    }


def describe_corpus(manifests: dict[str, Manifest]) -> str:
    lines = []
    for name, m in manifests.items():
        raw = m.num_tokens * np.dtype(m.token_dtype).itemsize
        lines.append(
            f"  {name:<6} {m.num_records:>7,} docs {m.num_tokens:>11,} tokens "
            f"{m.num_shards:>3} shards {m.num_bytes / 2**20:6.1f} MiB "
            f"({m.num_bytes / max(raw, 1):.0%} of the raw token bytes)"
        )
    return "\n".join(lines)


# -- streaming ---------------------------------------------------------------------------------
def progress_disabled() -> bool:
    return bool(os.environ.get("STREAMFORGE_NO_PROGRESS"))


@dataclass
class RunResult:
    batches: int
    tokens: int
    seconds: float
    source_tokens: np.ndarray  # tokens per stream (padding excluded)
    share_history: np.ndarray  # [batches, streams] cumulative tokens per stream
    state: dict[str, Any] | None  # loader state after ``resume_at`` batches
    after_state: list[dict[str, Any]]  # the batches that followed it


def stream_batches(
    make_loader: Callable[[], Any], *, max_batches: int, resume_at: int, num_check: int
) -> RunResult:
    """One pass (at most ``max_batches``), keeping the state at ``resume_at`` and the
    ``num_check`` batches after it."""
    from tqdm import tqdm

    loader = make_loader()
    counts = np.zeros(len(STREAMS), np.int64)
    state, after, tokens, batches = None, [], 0, 0
    history = []
    bar = tqdm(total=max_batches, unit="batch", disable=progress_disabled(), dynamic_ncols=True)
    start = time.perf_counter()
    for batch in loader:
        batches += 1
        ids = batch["source_ids"].numpy().ravel()
        counts += np.bincount(ids[ids >= 0], minlength=len(STREAMS))[: len(STREAMS)]
        history.append(counts.copy())
        tokens += batch["input_ids"].numel()
        if batches == resume_at:
            state = json.loads(json.dumps(loader.state_dict()))  # proves it is plain JSON
        elif state is not None and len(after) < num_check:
            after.append({k: v.clone() for k, v in batch.items()})
        bar.update(1)
        if batches % 10 == 0:
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{rate / 1e6:.2f}M tokens/s")
        if batches >= max_batches:
            break
    seconds = time.perf_counter() - start
    bar.close()
    history_array = np.asarray(history) if history else np.zeros((0, len(STREAMS)), np.int64)
    return RunResult(batches, tokens, seconds, counts, history_array, state, after)


def plot_mixture(history: np.ndarray, path: Path) -> Path | None:
    """Cumulative token share of each stream over the run, against its weight (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if len(history) == 0:
        return None
    totals = history.sum(axis=1)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, spec in enumerate(STREAMS):
        line = ax.plot(totals / 1e6, history[:, i] / np.maximum(totals, 1), label=f"{spec.name} (weight {spec.weight:.0%})")
        ax.axhline(spec.weight, color=line[0].get_color(), linestyle="--", linewidth=0.8)
    ax.set_xlabel("tokens streamed (millions)")
    ax.set_ylabel("share of tokens so far")
    ax.set_ylim(0, 1)
    ax.set_title("realized mixture vs weights (dashed)")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def check_resume(
    make_loader: Callable[[], Any], state: dict[str, Any], expected: list[dict[str, Any]]
) -> tuple[bool, str]:
    """Load ``state`` into a fresh loader; its next batches must equal ``expected``."""
    import torch

    loader = make_loader()
    loader.load_state_dict(state)
    batches = iter(loader)
    for i, want in enumerate(expected):
        got = next(batches, None)
        if got is None:
            return False, f"the resumed loader ended after {i} batches, expected {len(expected)}"
        for key, value in want.items():
            if key not in got or not torch.equal(got[key], value):
                return False, f"batch {i + 1} after the resume point differs in {key!r}"
    del batches
    return True, str(loader.resume_report)


# -- command line -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="streamforge demo",
        description="Build a small synthetic corpus (web/code/books), stream packed blocks from "
        "it and check exact resume.",
    )
    p.add_argument("--output-dir", default="demo-out", help="where the corpus goes (default: %(default)s)")
    p.add_argument("--tokens", default=str(DEFAULT_TOKENS),
                   help="corpus size in tokens, e.g. 4000000 or 4M (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batches", type=int, default=None,
                   help="stop after this many batches (default: one pass)")
    p.add_argument("--resume-at", type=int, default=20, help="batch after which state is saved")
    p.add_argument("--no-resume-check", action="store_true", help="skip the exact-resume check")
    args = p.parse_args(argv)
    args.tokens = parse_size(args.tokens)
    for name in ("seq_len", "batch_size", "resume_at"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_workers < 0:
        p.error("--num-workers must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from . import PackedTokenDataset, Stream, StreamingLoader

    out_dir = Path(args.output_dir).resolve()
    started = time.perf_counter()
    manifests = build_corpus(out_dir, args.tokens, args.seed)
    print(f"corpus in {out_dir} ({time.perf_counter() - started:.1f} s)")
    print(describe_corpus(manifests))

    streams = [Stream(str(out_dir / s.name), weight=s.weight, name=s.name) for s in STREAMS]

    def make_loader():
        dataset = PackedTokenDataset(
            streams, seq_len=args.seq_len, seed=args.seed, shuffle_buffer=8192,
            packing="concat", eos_id=EOS_ID,
        )
        return StreamingLoader(dataset, batch_size=args.batch_size, num_workers=args.num_workers)

    block_tokens = args.seq_len * args.batch_size
    total = sum(m.num_tokens + m.num_records for m in manifests.values())  # + one EOS each
    max_batches = args.max_batches or max(1, total // block_tokens)
    resume_at = min(args.resume_at, max(1, max_batches // 2))
    num_check = 0 if args.no_resume_check else min(4, max_batches - resume_at)
    print(
        f"streaming: batch {args.batch_size} x seq_len {args.seq_len}, "
        f"{args.num_workers} workers, up to {max_batches} batches"
    )
    run = stream_batches(make_loader, max_batches=max_batches, resume_at=resume_at, num_check=num_check)
    rate = run.tokens / max(run.seconds, 1e-9)
    print(
        f"streamed {run.batches} batches, {run.tokens:,} tokens in {run.seconds:.2f} s: "
        f"{rate / 1e6:.2f}M tokens/s, {run.batches / max(run.seconds, 1e-9):.1f} batches/s"
    )
    shares = run.source_tokens / max(int(run.source_tokens.sum()), 1)
    print("mixture (share of tokens, target in brackets): " + "  ".join(
        f"{s.name} {share:.1%} ({s.weight:.0%})" for s, share in zip(STREAMS, shares)
    ))
    plot = plot_mixture(run.share_history, out_dir / "mixture.png")
    if plot is not None:
        print(f"mixture plot: {plot}")
    if args.no_resume_check:
        return 0
    if run.state is None or not run.after_state:
        print(f"exact resume: not checked (the pass had only {run.batches} batches)")
        return 0
    state_path = out_dir / f"state-batch-{resume_at}.json"
    state_path.write_text(json.dumps(run.state, indent=1) + "\n")
    ok, detail = check_resume(make_loader, run.state, run.after_state)
    if not ok:
        print(f"exact resume: FAILED at batch {resume_at}: {detail}")
        return 1
    print(f"resume report: {detail}")
    print(
        f"exact resume: OK (state after batch {resume_at}, saved to {state_path.name}; the next "
        f"{len(run.after_state)} batches are bit-for-bit those of the uninterrupted run)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
