"""Pipeline tokens/s of this tree against another commit, measured in one run.

    python tools/bench_against.py [--rev HEAD~1] [--tokens 50e6] [--repeats 5]
                                  [--workers 0 2] [--section NAME] [--no-write]
                                  [--packing MODE] [--other-packing MODE]
                                  [--resume [--positions 0.1 0.5 0.9]]

The other commit's ``streamforge/`` is extracted with ``git archive`` under
``bench-out/against/REV/`` and its compiled core built there from its own sources (its
``setup.py build_ext --inplace``), so both trees run their compiled core where it builds
(the report says which path each ran); both trees stream the same corpus (``tools/bench_pipeline.py``'s,
built once under ``bench-out/pipeline/``) through ``PackedTokenDataset(url, seq_len=2048,
seed=0)`` and ``StreamingLoader(batch_size=8, num_workers=N)``, one pass each, in fresh
processes, alternating trees within every repeat so machine noise hits both alike. tokens/s
counts non-padding tokens delivered over the seconds from ``iter()`` to the end of the pass;
with 0 workers the tool also reports tokens per CPU-second of the process (all its threads),
which a shared machine disturbs far less than wall time. Each pass process runs one full
garbage collection before its clock starts (the debt its imports left), so that the collection
never lands inside one tree's pass and not the other's.

``--packing`` (this tree) and ``--other-packing`` (the other one; default the same) set the
dataset's packing, so one tree can be timed in two modes (``--rev HEAD --packing balance
--other-packing concat``).

With ``--resume`` the tool times resumes instead of passes: this tree saves its loader's state
at each of ``--positions`` of a pass (fractions of its batches), then each tree, in a fresh
process, builds the loader, loads a state and takes the first batch (the seconds of all three,
and of each); the trees alternate within every repeat.
Medians and the ratio this/other go to stdout and to the NAME section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
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
import gc, json, sys, time
from streamforge import PackedTokenDataset, StreamingLoader
url, workers = sys.argv[1], int(sys.argv[2])
packing = {"packing": sys.argv[3]} if len(sys.argv) > 3 else {}
loader = StreamingLoader(PackedTokenDataset(url, seq_len=2048, seed=0, **packing), batch_size=8, num_workers=workers)
tokens = batches = 0
# the full collection a fresh process owes for its imports (torch's objects: 60-120 ms) is paid
# before the clock starts, in either tree: left to run inside the pass, it lands in one tree's
# pass and not the other's as their allocations differ, a swing of about 15% on a 0.6 s pass
gc.collect()
start, cpu = time.perf_counter(), time.process_time()
for batch in loader:
    # counted in numpy as bench_peers does (padding only in a pass's last batch): three torch
    # ops a batch cost ~25 us, charged to both trees alike, which pulls their ratio toward 1
    doc_ids = batch["doc_ids"].numpy()
    tokens += doc_ids.size if doc_ids[-1, -1] >= 0 else int((doc_ids >= 0).sum())
    batches += 1
try:
    from streamforge.pipeline.core import name
except ImportError:  # a tree from before the compiled core
    name = lambda: "numpy"  # noqa: E731
print(json.dumps({"tokens": tokens, "batches": batches, "seconds": time.perf_counter() - start,
                  "cpu_seconds": time.process_time() - cpu, "core": name()}))
"""


CAPTURE = r"""
import pickle, sys
from streamforge import PackedTokenDataset, StreamingLoader
url, workers, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
at = {int(b) for b in sys.argv[4:]}
loader = StreamingLoader(PackedTokenDataset(url, seq_len=2048, seed=0), batch_size=8, num_workers=workers)
batches = 0
for batch in loader:
    batches += 1
    if batches in at:
        with open(f"{out}/state-{batches}.pkl", "wb") as f:
            pickle.dump(loader.state_dict(), f)
print(batches)
"""

RESUME = r"""
import json, pickle, sys, time
from streamforge import PackedTokenDataset, StreamingLoader
url, workers, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(path, "rb") as f:
    state = pickle.load(f)
t0 = time.perf_counter()
loader = StreamingLoader(PackedTokenDataset(url, seq_len=2048, seed=0), batch_size=8, num_workers=workers)
t1 = time.perf_counter()
loader.load_state_dict(state)
t2 = time.perf_counter()
next(iter(loader))
t3 = time.perf_counter()
print(json.dumps({"build": t1 - t0, "load": t2 - t1, "first": t3 - t2, "total": t3 - t0}))
"""


def extract(rev: str, dest_root: str) -> tuple[str, str]:
    """``streamforge/`` of ``rev`` under ``dest_root/<sha>``; returns (dir, short sha)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    dest = os.path.join(dest_root, sha)
    if not os.path.isdir(os.path.join(dest, "streamforge")):
        shutil.rmtree(dest, ignore_errors=True)
        names = subprocess.run(["git", "ls-tree", "--name-only", sha], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.split()
        paths = ["streamforge"] + [n for n in ("setup.py", "pyproject.toml") if n in names]
        blob = subprocess.run(["git", "archive", "--format=tar", sha, *paths], cwd=ROOT,
                              check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            tar.extractall(dest)
        if os.path.exists(os.path.join(dest, "setup.py")):  # its compiled core, as this tree has its own
            subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest,
                           capture_output=True)
    return dest, sha


def run_in(tree: str, script: str, *args) -> str:
    """The last line ``script`` prints, run in a fresh process that imports ``tree``'s streamforge."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=tree, env=env,
                         check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def one_pass(tree: str, url: str, workers: int, packing: str | None = None) -> dict:
    return json.loads(run_in(tree, PASS, url, workers, *([packing] if packing else [])))


def resumes(trees: dict, url: str, workers: int, positions: list[float], repeats: int) -> tuple[list, dict]:
    """States saved by ``trees["this"]`` at ``positions`` of a pass, each resumed ``repeats``
    times by every tree (alternated): ``(batches, {(tree, batch): [timings]})``."""
    out = os.path.join(ROOT, "bench-out", "against", "states")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    total = int(run_in(trees["this"], CAPTURE, url, workers, out))  # a pass's batches
    at = sorted({max(1, min(total - 1, round(f * total))) for f in positions})
    run_in(trees["this"], CAPTURE, url, workers, out, *at)
    got: dict = {}
    for r in range(repeats):
        for b in at:
            for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
                t = json.loads(run_in(trees[name], RESUME, url, workers, os.path.join(out, f"state-{b}.pkl")))
                got.setdefault((name, b), []).append(t)
                print(f"repeat {r + 1}/{repeats} batch {b}/{total} {name}: {t['total'] * 1e3:.1f} ms", flush=True)
    return [(b, total) for b in at], got


def resume_rows(at: list, got: dict) -> list[str]:
    def ms(name: str, b: int, key: str) -> float:
        return statistics.median(t[key] for t in got[(name, b)]) * 1e3

    rows = []
    for b, total in at:
        parts = {name: " / ".join(f"{ms(name, b, k):.1f}" for k in ("build", "load", "first")) for name in ("this", "other")}
        a, o = ms("this", b, "total"), ms("other", b, "total")
        rows.append(f"| {b}/{total} ({b / total:.0%}) | {a:.1f} ({parts['this']}) | {o:.1f} ({parts['other']}) | {a / o:.3f} |")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default="HEAD~1", help="the commit to compare with (default %(default)s)")
    p.add_argument("--this", default=None, help="measure this commit instead of the working tree")
    p.add_argument("--tokens", type=float, default=50e6, help="corpus size (default 50e6)")
    p.add_argument("--url", help="stream these passes over instead of the pipeline benchmark's corpus")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--section", default="against", help="docs/benchmarks.md section (default %(default)s)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--packing", help="this tree's packing (default: the dataset's, concat)")
    p.add_argument("--other-packing", help="the other tree's packing (default: --packing)")
    p.add_argument("--resume", action="store_true", help="time resumes (build, load_state_dict, first batch)")
    p.add_argument("--positions", type=float, nargs="+", default=[0.1, 0.5, 0.9],
                   help="with --resume: where in the pass the states are saved (default %(default)s)")
    args = p.parse_args(argv)
    if args.resume and args.section == "against":
        args.section = "against-resume"

    if args.url:
        # each tree runs in its own directory: a local path is made absolute here
        url = args.url if "://" in args.url else os.path.abspath(args.url)
        meta = {"url": url, "tokens": None}
    else:
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
    this_name = f"{head}{' + working tree' if dirty else ''}"
    command = "python tools/bench_against.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])  # as run
    packings = {"this": args.packing, "other": args.other_packing or args.packing}
    if args.packing or args.other_packing:
        this_name += f", packing={packings['this'] or 'concat'}"
    if args.resume:
        return resume_report(args, trees, meta, sha, this_name, command)
    rates: dict[tuple[str, int], list[float]] = {}
    cpu_rates: dict[tuple[str, int], list[float]] = {}
    cores = {}
    for workers in args.workers:  # one uncounted warm-up pass per tree (page cache, imports)
        for name, tree in trees.items():
            cores[name] = one_pass(tree, meta["url"], workers, packings[name]).get("core", "numpy")
    for r in range(args.repeats):
        for workers in args.workers:
            for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
                got = one_pass(trees[name], meta["url"], workers, packings[name])
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
    heading = f"## This tree against `{sha}` (`tools/bench_against.py`)"
    if args.packing or args.other_packing:
        heading = (f"## packing={packings['this'] or 'concat'} against packing={packings['other'] or 'concat'} "
                   "(`tools/bench_against.py`)")
    report(args, heading,
           f"{setting(command, meta)}; one pass of 8x2048 batches per run, fresh process per run, trees "
           f"alternated; medians of {args.repeats}. Hot loops: {cores['this']} (this), {cores['other']} (other; "
           "the tool builds the other tree's compiled core from its sources).",
           f"| num_workers | this ({this_name}) tokens/s | `{sha}`{other_packing(packings)} tokens/s | ratio |", rows)


def other_packing(packings: dict) -> str:
    return f", packing={packings['other'] or 'concat'}" if packings["this"] or packings["other"] else ""


def report(args, heading: str, intro: str, header: str, rows: list[str]) -> None:
    """Print a section (a heading, what was run, a four-column table) and write it to
    docs/benchmarks.md unless ``--no-write``."""
    text = "\n".join([heading, "", intro, "", header, "|---|---|---|---|", *rows])
    print(text)
    if not args.no_write:
        update_section(args.section, text)


def setting(command: str, meta: dict) -> str:
    return (f"`{command}`, {datetime.date.today()}, {platform.machine()} with {os.cpu_count()} CPUs (shared), "
            f"Python {platform.python_version()}. Corpus: {corpus_text(meta)}")


def corpus_text(meta: dict) -> str:
    if meta["tokens"] is None:
        return f"the stream at `{meta['url']}`"
    return f"the pipeline benchmark's ({meta['tokens']:,} tokens, {meta['documents']:,} documents)"


def resume_report(args, trees: dict, meta: dict, sha: str, this_name: str, command: str) -> None:
    workers = args.workers[-1]
    at, got = resumes(trees, meta["url"], workers, args.positions, args.repeats)
    report(args, f"## Resume: this tree against `{sha}` (`tools/bench_against.py --resume`)",
           f"{setting(command, meta)}, batches of 8x2048, {workers} workers. "
           "States saved by this tree's loader; each resume in a fresh process: building the loader, "
           f"`load_state_dict` and the first batch; trees alternated; medians of {args.repeats}, in ms "
           "(build / load / first batch).",
           f"| state saved after batch | this ({this_name}) | `{sha}` | ratio |", resume_rows(at, got))


if __name__ == "__main__":
    main()
