"""``streamforge demo``: the whole job on data it makes itself. Train, checkpoint, resume in a
new process, and land on the same loss curve, bit for bit.

1. Corpus (``./demo-out/``, 3M tokens by default, about 1 s; reused by the next run with the
   same parameters). Three streams of synthetic documents over a 512-token vocabulary (EOS
   511), written with ``ShardWriter``. Each document is an arithmetic sequence
   ``(start + stride * i) mod 511`` with some tokens replaced by Zipf-distributed noise. The
   streams differ in document length, strides and noise, so they differ in how well a model
   can predict them. With ``--s3`` the shards are served by a loopback S3 server (moto) that
   the demo starts and stops.

   ======  =========================  =======  =====  ===================
   stream  document length (tokens)   strides  noise  weights (phase 0/1)
   ======  =========================  =======  =====  ===================
   web     lognormal, median ~200     1, 2     35%    0.6 / 0.2
   code    lognormal, median ~600     1,3,5,7  5%     0.3 / 0.3
   books   lognormal, median ~3,000   1        15%    0.1 / 0.5
   ======  =========================  =======  =====  ===================

2. Reference run: a tiny causal transformer (``demo_train.py``) trains ``--steps`` steps on
   packed batches with document masking. The mixture schedule switches weights at
   ``--switch-at``. After ``--checkpoint-at`` steps the model, the optimizer and the loader
   state go to a checkpoint; training continues to the end.
3. Resumed run: a new process loads the checkpoint and trains to the end.
4. The resumed losses must equal the reference's from the checkpoint on, bit for bit (and the
   realized mixture per phase too). The report gives tokens/s, the mixture shares per stream
   and phase (``loader.stats()["phases"]``), the resume path and latency, and a PNG of both
   loss curves and the mixture.

Measured on 2 CPU cores (defaults: 300 steps of 8 x 256 tokens): about 25 s in all, 12 s of
them the reference run (about 50k tokens/s), the corpus under 1 s.
``STREAMFORGE_NO_PROGRESS=1`` hides the progress bars.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ManifestError
from ..format.manifest import Manifest
from ..format.writer import ShardWriter, parse_size
from .s3 import LoopbackS3

VOCAB_SIZE = 512
EOS_ID = 511
DEFAULT_TOKENS = 3_000_000
RESULTS = ("reference.json", "resumed.json")


@dataclass(frozen=True)
class StreamSpec:
    """How one synthetic stream is made: its share of the corpus, document lengths, content."""

    name: str
    weight: float  # phase 0, and the stream's share of the corpus
    late_weight: float  # from --switch-at on
    median_len: int
    sigma: float  # of log(length)
    strides: tuple[int, ...]
    noise: float  # probability that a token is replaced by a Zipf draw


STREAMS = (
    StreamSpec("web", 0.6, 0.2, 200, 1.0, (1, 2), 0.35),
    StreamSpec("code", 0.3, 0.3, 600, 0.8, (1, 3, 5, 7), 0.05),
    StreamSpec("books", 0.1, 0.5, 3000, 0.5, (1,), 0.15),
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


def document_tokens(spec: StreamSpec, lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """All documents' tokens, concatenated: arithmetic sequences mod EOS_ID, plus noise."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    offset = np.arange(int(lengths.sum())) - starts[doc]
    first = rng.integers(0, EOS_ID, size=len(lengths))
    stride = rng.choice(np.asarray(spec.strides), size=len(lengths))
    tokens = (first[doc] + stride[doc] * offset) % EOS_ID
    cdf, token_of_rank = zipf_table(EOS_ID, rng)
    noisy = rng.random(len(tokens)) < spec.noise
    tokens[noisy] = token_of_rank[np.searchsorted(cdf, rng.random(int(noisy.sum())))]
    return tokens.astype(np.uint16)


def build_stream(spec: StreamSpec, url: str, num_tokens: int, seed: int) -> Manifest:
    """Write one synthetic stream; an existing one made with the same parameters is reused."""
    fingerprint = f"streamforge-demo-v2:{spec}:{num_tokens}:{seed}"
    try:
        existing = Manifest.load(url)
        if existing.source_fingerprint == fingerprint:
            return existing
    except ManifestError:
        pass
    rng = np.random.default_rng([seed, STREAMS.index(spec)])
    lengths = document_lengths(spec, num_tokens, rng)
    tokens = document_tokens(spec, lengths, rng)
    shard_size = max(16 << 10, int(lengths.sum()) * 2 // 6)  # about six shards a stream
    frame_size = min(256 << 10, max(4 << 10, shard_size // 8))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    with ShardWriter(
        url, token_dtype="uint16", shard_size=shard_size, frame_size=frame_size,
        eos_id=EOS_ID, vocab_size=VOCAB_SIZE, source_fingerprint=fingerprint, overwrite=True,
        conversion={"source": "streamforge demo (synthetic)", "stream": spec.name},
    ) as writer:
        for i in range(len(lengths)):
            writer.write(tokens[bounds[i] : bounds[i + 1]])
    return writer.close()


def build_corpus(out_dir: Path, num_tokens: int, seed: int) -> dict[str, Manifest]:
    """The demo's streams under ``out_dir``, by name."""
    return {
        spec.name: build_stream(spec, str(out_dir / spec.name), int(num_tokens * spec.weight), seed)
        for spec in STREAMS
    }


def describe_corpus(manifests: dict[str, Manifest]) -> str:
    return "\n".join(
        f"  {name:<6} {m.num_records:>7,} docs {m.num_tokens:>11,} tokens {m.num_shards:>3} shards "
        f"{m.num_bytes / 2**20:6.1f} MiB"
        for name, m in manifests.items()
    )


# -- command line -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="streamforge demo",
        description="Build a small synthetic corpus, train a tiny transformer on it with a mixture "
        "schedule, checkpoint midway, resume in a new process and compare the loss curves bit for bit.",
    )
    p.add_argument("--output-dir", default="demo-out", help="corpus, checkpoint, results (default: %(default)s)")
    p.add_argument("--tokens", default=str(DEFAULT_TOKENS), help="corpus size, e.g. 3M (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-at", type=int, default=None, help="default: 40%% of --steps")
    p.add_argument("--switch-at", type=int, default=None, help="mixture switch step; default: half of --steps")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--s3", action="store_true", help="serve the corpus from a loopback S3 server")
    p.add_argument("--resume-from", type=Path, default=None, help=argparse.SUPPRESS)  # the new process
    args = p.parse_args(argv)
    args.tokens = parse_size(args.tokens)
    for name in ("steps", "seq_len", "batch_size", "d_model", "num_layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_workers < 0:
        p.error("--num-workers must be >= 0")
    if args.steps < 2:
        p.error("--steps must be >= 2 (a checkpoint midway)")
    args.checkpoint_at = args.checkpoint_at or max(1, args.steps * 2 // 5)
    args.switch_at = args.switch_at if args.switch_at is not None else args.steps // 2
    if not 0 < args.checkpoint_at < args.steps:
        p.error(f"--checkpoint-at must be in 1..{args.steps - 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.resume_from is not None:
        return resumed_process(args.resume_from, out_dir)
    server = None
    if args.s3:
        try:
            server = LoopbackS3(key="demo", secret="demo").start()
        except ImportError:
            print("--s3 needs moto's server: .venv/bin/pip install -c constraints.txt 'moto[server]'")
            return 2
    try:
        return reference_and_resume(args, out_dir, server)
    finally:
        if server is not None:
            server.stop()


def reference_and_resume(args: argparse.Namespace, out_dir: Path, server: LoopbackS3 | None) -> int:
    from .train import JobConfig, train
    from .report import compare, report

    import torch

    started = time.perf_counter()
    manifests = build_corpus(out_dir / "corpus", args.tokens, args.seed)
    where = "local disk"
    streams = []
    for spec in STREAMS:
        url, options = str(out_dir / "corpus" / spec.name), None
        if server is not None:
            url = server.upload(out_dir / "corpus" / spec.name, "streamforge-demo", spec.name)
            options = server.storage_options(skip_instance_cache=False)
            where = f"loopback S3 at {server.endpoint_url}"
        streams.append({"url": url, "weight": spec.weight, "name": spec.name, "storage_options": options})
    print(f"[1/4] corpus in {out_dir / 'corpus'}, served from {where} ({time.perf_counter() - started:.1f} s)")
    print(describe_corpus(manifests))
    schedule = [(0, {s.name: s.weight for s in STREAMS})]
    if 0 < args.switch_at < args.steps:
        schedule.append((args.switch_at, {s.name: s.late_weight for s in STREAMS}))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = JobConfig(
        streams=streams, schedule=schedule, vocab_size=VOCAB_SIZE, eos_id=EOS_ID, steps=args.steps,
        checkpoint_at=args.checkpoint_at, seq_len=args.seq_len, batch_size=args.batch_size,
        num_workers=args.num_workers, seed=args.seed, d_model=args.d_model, num_layers=args.num_layers,
        threads=max(1, min(4, os.cpu_count() or 1)), device=device,
    )
    print(f"[2/4] reference run: {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens on {device}, "
          f"checkpoint after step {cfg.checkpoint_at}, mixture switch at step {args.switch_at}")
    ref = train(cfg, out_dir, bar_desc="reference")
    _write(out_dir / RESULTS[0], ref)
    print(f"[3/4] resuming from {ref.checkpoint} in a new process")
    spawned = time.perf_counter()
    child = subprocess.run([sys.executable, "-m", "streamforge.demo.run", "--output-dir", str(out_dir),
                            "--resume-from", str(ref.checkpoint)])
    if child.returncode != 0:
        print(f"the resumed process failed (exit code {child.returncode})")
        return 1
    resumed = json.loads((out_dir / RESULTS[1]).read_text())
    resumed["process_s"] = time.perf_counter() - spawned
    print("[4/4] comparing")
    ok, lines = compare(json.loads((out_dir / RESULTS[0]).read_text()), resumed, cfg.checkpoint_at)
    print("\n".join(report(cfg, ref, resumed, out_dir, ok, lines, time.perf_counter() - started)))
    return 0 if ok else 1


def resumed_process(checkpoint: Path, out_dir: Path) -> int:
    """The new process: rebuild the job from the checkpoint alone and train to the end."""
    from .train import config_from_checkpoint, train

    cfg = config_from_checkpoint(checkpoint)
    result = train(cfg, out_dir, resume_from=checkpoint, bar_desc="resumed")
    _write(out_dir / RESULTS[1], result)
    return 0


def _write(path: Path, result: Any) -> None:
    from .train import bits

    path.write_text(json.dumps({
        "first_step": result.first_step, "losses": result.losses, "loss_bits": bits(result.losses),
        "seconds": result.seconds, "data_wait_s": result.data_wait_s, "tokens": result.tokens,
        "stats": result.stats, "checkpoint": str(result.checkpoint) if result.checkpoint else None,
        "resume_latency_s": result.resume_latency_s,
    }, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
