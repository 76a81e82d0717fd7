"""Memory over many passes: does the training process grow pass after pass?

The loader is iterated pass after pass, as a trainer iterates an evaluation loader once per
evaluation, and the training process's resident memory (``/proc/self/statm``) is printed every
``--every`` passes with its private anonymous part (``RssAnon``). At the end, the slope: a
least-squares line through the readings after ``--warm-up`` passes, in MiB a pass, and the
growth from the first of them to the last. Worker processes are not counted: they are new
each pass.

    python tools/soak_memory.py                          # 300 passes, 2 workers, the 50M-token corpus
    python tools/soak_memory.py --passes 1000 --every 50 --workers 0
    python tools/soak_memory.py --corpus PATH_OR_URL --seq-len 512 --batch-size 4

The default corpus is ``tools/bench_peers.py``'s (``--tokens``, 50M), built once under
``bench-out/peers/t<tokens>/`` (and shared with it); ``--corpus`` reads an existing stream
instead. The loader is the benchmark's: ``seq_len=2048``, batches of 8, ``seed=0``, CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from streamforge import PackedTokenDataset, Stream, StreamingLoader  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> tuple[float, float]:
    """(resident, private anonymous resident) MiB of this process."""
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * PAGE / 2**20
    anon = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) / 1024
    return resident, anon


def bench_corpus(workdir: str, tokens: int) -> str:
    """The streamforge copy of ``tools/bench_peers.py``'s corpus of ``tokens`` tokens, written
    once (and recorded in its ``corpus.json``, where the benchmark finds it too)."""
    import bench_peers

    meta = bench_peers.ensure_flat(os.path.join(workdir, f"t{tokens}"), tokens)
    have = meta["formats"].get("streamforge")
    if have and "error" not in have and os.path.isdir(have["dir"]):
        return have["dir"]
    out = os.path.join(meta["root"], "fmt", "streamforge")
    print(f"writing the {tokens:,}-token corpus to {out} ...", flush=True)
    start = time.perf_counter()
    bench_peers.write_streamforge(meta, out)
    size, files = bench_peers.dir_bytes(out)
    meta["formats"]["streamforge"] = {"dir": out, "bytes": size, "files": files,
                                      "write_s": time.perf_counter() - start}
    bench_peers.save_meta(meta)
    return out


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of ``(pass, MiB)`` points, MiB a pass."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=300)
    p.add_argument("--every", type=int, default=25, help="print a reading every this many passes")
    p.add_argument("--warm-up", type=int, default=30, help="passes before the slope's first reading")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--corpus", help="an existing stream (path or URL); default: the benchmark corpus")
    p.add_argument("--tokens", type=float, default=50e6, help="size of the benchmark corpus (default 50e6)")
    p.add_argument("--workdir", default=os.path.join(ROOT, "bench-out", "peers"))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)
    if args.passes <= args.warm_up:
        p.error("--passes must be more than --warm-up")

    corpus = args.corpus or bench_corpus(args.workdir, int(args.tokens))
    dataset = PackedTokenDataset(Stream(corpus, name="corpus"), seq_len=args.seq_len, seed=0)
    loader = StreamingLoader(dataset, batch_size=args.batch_size, num_workers=args.workers, device="cpu")
    print(f"soak: {corpus}, {args.workers} workers, seq_len {args.seq_len}, batches of {args.batch_size}, "
          f"{loader.steps_per_pass} steps a pass, {args.passes} passes", flush=True)
    print(f"{'pass':>6} {'rss_mib':>9} {'anon_mib':>9} {'s/pass':>7}", flush=True)
    readings: list[tuple[int, float]] = []
    start = last = time.perf_counter()
    last_pass = 0
    for pass_idx in range(args.passes):
        for _ in loader:
            pass
        done = pass_idx + 1
        if done % args.every and done != args.passes and done != args.warm_up:
            continue
        resident, anon = rss_mib()
        now = time.perf_counter()
        print(f"{done:>6} {resident:>9.1f} {anon:>9.1f} {(now - last) / (done - last_pass):>7.3f}", flush=True)
        last, last_pass = now, done
        if done >= args.warm_up:
            readings.append((done, resident))
    (first, rss_first), (end, rss_end) = readings[0], readings[-1]
    print(f"slope: {slope(readings):+.4f} MiB/pass over passes {first}-{end} "
          f"(rss {rss_first:.1f} -> {rss_end:.1f} MiB, {rss_end - rss_first:+.1f}); "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
