"""What bounds a 0-worker pass from local disk: the reader's waits for read-ahead, and how
busy the fetch threads are, by read-ahead budget and fetch threads.

    python tools/bench_readahead.py [--url URL] [--tokens 50e6] [--threads 1 2]
                                    [--budgets 16 64] [--repeats 5] [--no-write]

Two ways through the same stream, each case in a fresh process, cases alternated within
every repeat: ``pipeline``, one worker's pipeline alone (``dataset.make_pipeline(0, 1)``,
``next_batch(8)`` to the end: reading, shuffling and packing, as a DataLoader worker does
it), and ``loader``, ``StreamingLoader(batch_size=8, num_workers=0)``, which also expands
every batch into the five tensors of the contract on the same thread. Each reports the
seconds of the pass, ``stats()``'s ``prefetch_wait_s`` (the reader waiting for frames) and
``fetch_busy_s`` (the fetch threads fetching and decoding, summed over threads), and the
process's peak RSS. Medians (min-max) go to stdout and to the ``readahead`` section of
docs/benchmarks.md. ``--url`` streams an existing corpus (``tools/bench_peers.py`` writes
``bench-out/peers/t50000000/fmt/streamforge``); without it, the pipeline benchmark's corpus
is built once under ``bench-out/pipeline/``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _benchdoc import spread, update_section  # noqa: E402

PASS = r"""
import json, resource, sys, time
from streamforge import PackedTokenDataset, StorageConfig, StreamingLoader
url, mode, budget, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
storage = StorageConfig(prefetch_bytes=budget, prefetch_threads=threads)
dataset = PackedTokenDataset(url, seq_len=2048, seed=0, storage=storage)
tokens = 0
start = time.perf_counter()
if mode == "pipeline":
    pipeline = dataset.make_pipeline(0, 1)
    while (rows := pipeline.next_batch(8)) is not None:
        tokens += rows.num_tokens
    seconds = time.perf_counter() - start
    streams = [pipeline.stats()[name] for name in dataset.stream_names]
    pipeline.close()
else:
    loader = StreamingLoader(dataset, batch_size=8, num_workers=0, device="cpu")
    for batch in loader:
        tokens += int((batch["doc_ids"] >= 0).sum())
    seconds = time.perf_counter() - start
    streams = [loader.stats()["streams"][name] for name in dataset.stream_names]
print(json.dumps({"tokens": tokens, "seconds": seconds, "wait": sum(s["prefetch_wait_s"] for s in streams),
                  "busy": sum(s["fetch_busy_s"] for s in streams), "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def one_pass(url: str, mode: str, budget: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PASS, url, mode, str(budget), str(threads)], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the {mode} pass ({budget >> 20} MiB, {threads} threads) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="an existing stream (default: the pipeline benchmark's corpus)")
    p.add_argument("--tokens", type=float, default=50e6, help="size of the built corpus (without --url)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64], help="read-ahead budgets, MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    if args.url:
        url, about = args.url, f"`{args.url}`"
    else:
        from bench_pipeline import ensure_corpus

        meta = ensure_corpus(os.path.join(ROOT, "bench-out", "pipeline"), int(args.tokens))
        url, about = meta["url"], f"the pipeline benchmark's ({meta['tokens']:,} tokens, {meta['documents']:,} documents)"
    cases = list(itertools.product(("pipeline", "loader"), args.budgets, args.threads))
    for mode, budget, threads in cases:  # one uncounted pass per case: page cache, imports
        one_pass(url, mode, budget << 20, threads)
    got: dict[tuple, list[dict]] = {case: [] for case in cases}
    for r in range(args.repeats):
        for case in (cases if r % 2 == 0 else cases[::-1]):
            mode, budget, threads = case
            result = one_pass(url, mode, budget << 20, threads)
            got[case].append(result)
            print(f"repeat {r + 1}/{args.repeats} {mode} {budget} MiB x {threads}: {result['seconds']:.3f} s, "
                  f"waits {result['wait']:.3f} s, fetch busy {result['busy']:.3f} s", flush=True)
    rows = []
    for mode in ("pipeline", "loader"):
        base = statistics.median(r["seconds"] for r in got[(mode, args.budgets[0], args.threads[0])])
        for budget, threads in itertools.product(args.budgets, args.threads):
            runs = got[(mode, budget, threads)]
            seconds = [r["seconds"] for r in runs]
            busy_share = [r["busy"] / (r["seconds"] * threads) for r in runs]
            rows.append(
                f"| {mode} | {budget} MiB | {threads} | {spread(seconds, fmt='{:.3f}')} | "
                f"{statistics.median(r['tokens'] / r['seconds'] for r in runs) / 1e6:.1f}M | "
                f"{base / statistics.median(seconds):.2f}x | {spread([r['wait'] for r in runs], fmt='{:.3f}')} | "
                f"{spread(busy_share, 0.01, '{:.0f}')}% | {statistics.median(r['rss_mib'] for r in runs):.0f} |"
            )
    command = "python tools/bench_readahead.py" + (f" --url {args.url}" if args.url else "") + (
        f" --threads {' '.join(map(str, args.threads))} --budgets {' '.join(map(str, args.budgets))}"
        f" --repeats {args.repeats}")
    text = "\n".join([
        "## What bounds a 0-worker pass: read-ahead waits and fetch threads (`tools/bench_readahead.py`)",
        "",
        f"`{command}`, {datetime.date.today()}, {platform.machine()} with {os.cpu_count()} CPUs (shared), "
        f"Python {platform.python_version()}. Stream: {about}; one pass of 8x2048 batches per run, fresh "
        f"process per run, cases alternated; medians (min-max) of {args.repeats}. `pipeline`: one worker's "
        "pipeline alone (read, shuffle, pack); `loader`: `StreamingLoader(num_workers=0)`, which also expands "
        "each batch into the contract's five tensors on the same thread. Waits: `stats()['prefetch_wait_s']`; "
        "fetch threads busy: `stats()['fetch_busy_s']` over the pass's seconds times the threads.",
        "",
        "| pass | read-ahead | fetch threads | seconds | tokens/s | speed-up | reader waits, s | fetch threads busy | peak RSS, MiB |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    print(text)
    if not args.no_write:
        update_section("readahead", text)


if __name__ == "__main__":
    main()
