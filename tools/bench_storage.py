"""Stream one corpus from local disk and from a loopback S3 server; print and record figures.

Per configuration (backend x num_workers): tokens/s over a full pass, time to first batch,
resume latency (a fresh loader restored from a mid-pass state, to its first batch), bytes
fetched / bytes of frames decoded, requests per shard, and peak memory (RSS) per worker.

The S3 server is moto's ThreadedMotoServer in a child process on 127.0.0.1, so its memory
and CPU are not charged to the reader. Figures go to ``docs/benchmarks.md`` between
``<!-- bench:storage -->`` and ``<!-- /bench:storage -->``.

    python tools/bench_storage.py --tokens 40e6
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from streamforge import PackedTokenDataset, Stream, StreamingLoader  # noqa: E402
from streamforge.demo.s3 import LoopbackS3  # noqa: E402
from streamforge.format.writer import ShardWriter  # noqa: E402
from streamforge.storage.config import StorageConfig  # noqa: E402

def start_s3() -> tuple[LoopbackS3, dict]:
    """moto's S3 in a child process of its own (its CPU and memory are not the reader's), and
    the storage options to reach it."""
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = LoopbackS3(key="bench", secret="bench", in_process=False).start()
    return server, server.storage_options()


def write_corpus(url, num_tokens, opts, seed=0):
    """Zipf-distributed token ids (compress like text), document lengths from a log-normal."""
    rng = np.random.default_rng(seed)
    written = 0
    with ShardWriter(url, shard_size="16MiB", storage_options=opts, eos_id=0) as writer:
        while written < num_tokens:
            n = int(min(8192, max(16, rng.lognormal(6.5, 1.0))))
            writer.write(np.minimum(rng.zipf(1.2, n), 50_000).astype(np.uint16))
            written += n
    return writer.close()


def make_loader(url, opts, num_workers, storage, seq_len, batch_size):
    ds = PackedTokenDataset(
        [Stream(url, weight=1.0, name="web", storage_options=opts)],
        seq_len=seq_len, seed=0, shuffle_buffer=8192, packing="concat", eos_id=0, storage=storage,
    )
    return StreamingLoader(ds, batch_size=batch_size, num_workers=num_workers)


def totals(stats, key):
    if isinstance(stats, dict):
        return sum(v if k == key and isinstance(v, (int, float)) else totals(v, key)
                   for k, v in stats.items())
    return 0


def peak_rss_mb(num_workers):
    who = resource.RUSAGE_SELF if num_workers == 0 else resource.RUSAGE_CHILDREN
    return resource.getrusage(who).ru_maxrss / 1024


def run_config(url, opts, num_workers, manifest, args):
    """One configuration, measured in a child process so peak memory is its own."""
    storage = StorageConfig()
    loader = make_loader(url, opts, num_workers, storage, args.seq_len, args.batch_size)
    start = time.perf_counter()
    first = None
    tokens = 0
    mid_state = None
    for i, batch in enumerate(loader):
        if first is None:
            first = time.perf_counter() - start
        tokens += int(batch["input_ids"].numel())
        if i == 20:
            mid_state = loader.state_dict()
    elapsed = time.perf_counter() - start
    stats = loader.stats()
    resumed = make_loader(url, opts, num_workers, storage, args.seq_len, args.batch_size)
    t0 = time.perf_counter()
    resumed.load_state_dict(mid_state)
    next(iter(resumed))
    resume = time.perf_counter() - t0
    fetched, needed = totals(stats, "bytes_fetched"), totals(stats, "bytes_needed")
    return {
        "tokens_per_s": tokens / elapsed,
        "first_batch_s": first,
        "resume_s": resume,
        "amplification": fetched / needed if needed else float("nan"),
        "requests_per_shard": totals(stats, "requests") / manifest.num_shards,
        "retries": totals(stats, "retries"),
        "peak_rss_mb": peak_rss_mb(num_workers),
    }


def child_main(args):
    import json

    from streamforge.format.manifest import Manifest

    opts = json.loads(args.opts) if args.opts else None
    manifest = Manifest.load(args.url, opts)
    result = run_config(args.url, opts, args.num_workers, manifest, args)
    print("RESULT " + json.dumps(result), flush=True)


def measure(url, opts, num_workers, args):
    import json

    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--url", url,
           "--num-workers", str(num_workers), "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--opts", json.dumps(opts) if opts else ""]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=float, default=40e6)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--no-doc", action="store_true", help="print only; leave docs/ alone")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--opts", help=argparse.SUPPRESS)
    parser.add_argument("--num-workers", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args)

    workdir = tempfile.mkdtemp(prefix="sf-bench-")
    server, opts = start_s3()
    try:
        server.create_bucket("bench")
        local_url, s3_url = os.path.join(workdir, "web"), "s3://bench/web"
        manifest = write_corpus(local_url, int(args.tokens), None)
        write_corpus(s3_url, int(args.tokens), opts)
        rows = []
        for name, url, o in (("local", local_url, None), ("s3", s3_url, opts)):
            for workers in (0, 2):
                r = measure(url, o, workers, args)
                rows.append((name, workers, r))
                print(name, workers, {k: round(v, 3) for k, v in r.items()}, flush=True)
    finally:
        server.stop()
    report(rows, manifest, args)


def report(rows, manifest, args):
    by = {(n, w): r for n, w, r in rows}
    lines = [
        "## Storage: local disk vs loopback S3 (`tools/bench_storage.py`)",
        "",
        f"Corpus: {manifest.num_tokens / 1e6:.1f}M uint16 tokens, {manifest.num_shards} shards, "
        f"{manifest.num_bytes / 2**20:.0f} MiB; seq_len {args.seq_len}, batch_size "
        f"{args.batch_size}, StorageConfig defaults (read-ahead: local 4 MiB on one fetch thread, "
        "S3 64 MiB on four). S3 is moto's "
        f"ThreadedMotoServer on 127.0.0.1 in its own process. Machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}.",
        "",
        "| backend | workers | tokens/s | first batch (s) | resume (s) | fetched/needed "
        "| requests/shard | peak RSS/worker (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, workers, r in rows:
        lines.append(
            f"| {name} | {workers} | {r['tokens_per_s'] / 1e6:.2f}M | {r['first_batch_s']:.2f} | "
            f"{r['resume_s']:.2f} | {r['amplification']:.3f} | {r['requests_per_shard']:.1f} | "
            f"{r['peak_rss_mb']:.0f} |"
        )
    ratio = by[("s3", 2)]["tokens_per_s"] / by[("local", 2)]["tokens_per_s"]
    lines += [
        "",
        f"S3 / local throughput at 2 workers: {ratio:.0%} (target >= 80%). Peak RSS includes "
        "the Python and torch runtime of the process (about 300 MB of it before any data).",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_doc:
        try:
            from _benchdoc import update_section
        except ImportError:  # pragma: no cover - the shared helper is part of tools/
            return
        update_section("storage", text)


if __name__ == "__main__":
    main()
