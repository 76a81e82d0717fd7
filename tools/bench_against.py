"""Pipeline tokens/s of this tree against another commit, measured in one run.

    python tools/bench_against.py [--rev HEAD~1] [--tokens 50e6] [--repeats 5]
                                  [--workers 0 2] [--section NAME] [--no-write]

The other commit's ``streamforge/`` is extracted with ``git archive`` under
``bench-out/against/REV/``; both trees stream the same corpus (``tools/bench_pipeline.py``'s,
built once under ``bench-out/pipeline/``) through ``PackedTokenDataset(url, seq_len=2048,
seed=0)`` and ``StreamingLoader(batch_size=8, num_workers=N)``, one pass each, in fresh
processes, alternating trees within every repeat so machine noise hits both alike. tokens/s
counts non-padding tokens delivered over the seconds from ``iter()`` to the end of the pass;
with 0 workers the tool also reports tokens per CPU-second of the process (all its threads),
which a shared machine disturbs far less than wall time.
Medians and the ratio this/other go to stdout and to the NAME section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import io

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _benchdoc import update_section  # noqa: E402

PASS = r"""
import json, sys, time
from streamforge import PackedTokenDataset, StreamingLoader
url, workers = sys.argv[1], int(sys.argv[2])
loader = StreamingLoader(PackedTokenDataset(url, seq_len=2048, seed=0), batch_size=8, num_workers=workers)
tokens = batches = 0
start, cpu = time.perf_counter(), time.process_time()
for batch in loader:
    tokens += int((batch["doc_ids"] >= 0).sum())
    batches += 1
print(json.dumps({"tokens": tokens, "batches": batches, "seconds": time.perf_counter() - start,
                  "cpu_seconds": time.process_time() - cpu}))
"""


def extract(rev: str, dest_root: str) -> tuple[str, str]:
    """``streamforge/`` of ``rev`` under ``dest_root/<sha>``; returns (dir, short sha)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    dest = os.path.join(dest_root, sha)
    if not os.path.isdir(os.path.join(dest, "streamforge")):
        shutil.rmtree(dest, ignore_errors=True)
        blob = subprocess.run(["git", "archive", "--format=tar", sha, "streamforge"], cwd=ROOT,
                              check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            tar.extractall(dest)
    return dest, sha


def one_pass(tree: str, url: str, workers: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", PASS, url, str(workers)], cwd=tree, env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default="HEAD~1", help="the commit to compare with (default %(default)s)")
    p.add_argument("--this", default=None, help="measure this commit instead of the working tree")
    p.add_argument("--tokens", type=float, default=50e6, help="corpus size (default 50e6)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--section", default="against", help="docs/benchmarks.md section (default %(default)s)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    from bench_pipeline import ensure_corpus  # the same corpus as the pipeline benchmark

    meta = ensure_corpus(os.path.join(ROOT, "bench-out", "pipeline"), int(args.tokens))
    other, sha = extract(args.rev, os.path.join(ROOT, "bench-out", "against"))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "streamforge"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    trees = {"this": ROOT, "other": other}
    if args.this:
        trees["this"], head = extract(args.this, os.path.join(ROOT, "bench-out", "against"))
        dirty = False
    rates: dict[tuple[str, int], list[float]] = {}
    cpu_rates: dict[tuple[str, int], list[float]] = {}
    for workers in args.workers:  # one uncounted warm-up pass per tree (page cache, imports)
        for tree in trees.values():
            one_pass(tree, meta["url"], workers)
    for r in range(args.repeats):
        for workers in args.workers:
            for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
                got = one_pass(trees[name], meta["url"], workers)
                rates.setdefault((name, workers), []).append(got["tokens"] / got["seconds"])
                cpu_rates.setdefault((name, workers), []).append(got["tokens"] / got["cpu_seconds"])
                print(f"repeat {r + 1}/{args.repeats} workers={workers} {name}: "
                      f"{got['tokens'] / got['seconds'] / 1e6:.1f}M tokens/s ({got['batches']} batches)", flush=True)
    rows = []
    for workers in args.workers:
        a, b = statistics.median(rates[("this", workers)]), statistics.median(rates[("other", workers)])
        rows.append(f"| {workers} | {a / 1e6:.1f}M | {b / 1e6:.1f}M | {a / b:.3f} |")
        if workers == 0:
            a, b = statistics.median(cpu_rates[("this", 0)]), statistics.median(cpu_rates[("other", 0)])
            rows.append(f"| 0, per CPU-second of the process | {a / 1e6:.1f}M | {b / 1e6:.1f}M | {a / b:.3f} |")
    this_name = f"{head}{' + working tree' if dirty else ''}"
    text = "\n".join([
        f"## This tree against `{sha}` (`tools/bench_against.py`)",
        "",
        f"`python tools/bench_against.py --rev {args.rev}{f' --this {args.this}' if args.this else ''}`, {datetime.date.today()}, {platform.machine()} with "
        f"{os.cpu_count()} CPUs (shared), Python {platform.python_version()}. Corpus: the pipeline benchmark's "
        f"({meta['tokens']:,} tokens, {meta['documents']:,} documents); one pass of 8x2048 batches per run, "
        f"fresh process per run, trees alternated; medians of {args.repeats}.",
        "",
        f"| num_workers | this ({this_name}) tokens/s | `{sha}` tokens/s | ratio |",
        "|---|---|---|---|",
        *rows,
    ])
    print(text)
    if not args.no_write:
        update_section(args.section, text)


if __name__ == "__main__":
    main()
