"""Resume latency on another topology: elastic (and, for reference, exact and statistical)
against a fresh start, at 10%, 50% and 90% of a pass.

    python tools/bench_resume.py [--tokens 50e6] [--repeats 5] [--no-write] [--out docs/benchmarks.md]

The corpus is ``tools/bench_pipeline.py``'s (one stream, lognormal documents of median 600,
64 MiB shards, built once under ``bench-out/pipeline/``). The saved job runs 2 ranks x 1
worker (in this process, ranks given explicitly), batch 8 x 2048, to the position; its
ranks' states are joined with ``merge_states``. Each resume case then times, in this
process: a new dataset + loader + ``load_state_dict`` + the first batch, for

* exact: the same topology (rank 0 of 2, no worker processes);
* elastic: 1 rank, no worker processes, batch 4 (the rest of the pass re-planned);
* elastic, 2 workers: 1 rank with 2 worker processes, batch 8;
* statistical: like elastic, with ``mode="statistical"``;

against a fresh start of the same loader (new dataset + loader + first batch). Medians over
``--repeats``; the figures go to the ``resume-elastic`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_pipeline as bp  # noqa: E402
from tqdm import tqdm  # noqa: E402

from streamforge import PackedTokenDataset, StreamingLoader, merge_states  # noqa: E402

POSITIONS = (0.1, 0.5, 0.9)
TARGET = 2.0
CASES = {
    "exact": dict(rank=0, world=2, workers=0, batch=8, mode=None),
    "elastic": dict(rank=0, world=1, workers=0, batch=4, mode=None),
    "elastic-w2": dict(rank=0, world=1, workers=2, batch=8, mode=None),
    "statistical": dict(rank=0, world=1, workers=0, batch=4, mode="statistical"),
}


def make(url: str, rank: int, world: int, workers: int, batch: int) -> StreamingLoader:
    ds = PackedTokenDataset(url, seq_len=bp.SEQ_LEN, seed=0, rank=rank, world_size=world)
    return StreamingLoader(ds, batch_size=batch, num_workers=workers)


def saved_state(url: str, fraction: float) -> tuple[dict, int, int]:
    """The 2-rank job's state at ``fraction`` of its pass, its step, and the pass's steps."""
    ranks = [make(url, r, 2, 0, 8) for r in range(2)]
    steps = ranks[0].steps_per_pass
    cut = max(1, int(steps * fraction))
    for loader in ranks:
        it = iter(loader)
        for _ in range(cut):
            next(it)
        it.close()
    return merge_states([r.state_dict() for r in ranks]), cut, steps


def first_batch(url: str, case: dict, state: dict | None) -> tuple[float, str]:
    start = time.perf_counter()
    loader = make(url, case["rank"], case["world"], case["workers"], case["batch"])
    if state is not None:
        loader.load_state_dict(state, mode=case["mode"])
    it = iter(loader)
    next(it)
    elapsed = time.perf_counter() - start
    it.close()
    return elapsed, loader.resume_report.mode if state is not None else "fresh"


def measure(url: str, repeats: int) -> dict:
    out: dict = {"fresh": {}, "resume": {}, "cut": {}}
    states = {}
    for f in tqdm(POSITIONS, desc="saving states", leave=False):
        states[f], out["cut"][f], out["steps"] = saved_state(url, f)
    total = repeats * len(CASES) * (1 + len(POSITIONS))
    with tqdm(total=total, desc="resume latency", leave=False) as bar:
        for _ in range(repeats):
            for name, case in CASES.items():
                elapsed, _ = first_batch(url, case, None)
                out["fresh"].setdefault(name, []).append(elapsed)
                bar.update()
                for f in POSITIONS:
                    elapsed, mode = first_batch(url, case, states[f])
                    assert mode == name.split("-")[0], (name, mode)
                    out["resume"].setdefault((name, f), []).append(elapsed)
                    bar.update()
    return out


def section(r: dict, meta: dict, command: str) -> str:
    med = statistics.median
    head = " | ".join(f"at {f:.0%} (step {r['cut'][f]}/{r['steps']})" for f in POSITIONS)
    lines = [
        "## Resume latency on another topology (`tools/bench_resume.py`)", "",
        f"`{command}`, {datetime.date.today().isoformat()}, {bp.machine()}.",
        f"Corpus: {meta['tokens']:,} tokens in {meta['shards']} shard(s) (the pipeline benchmark's). Saved "
        "job: 2 ranks x 1 worker, batch 8 x 2048, its ranks' states joined with `merge_states`. Each cell: new "
        "dataset + loader + `load_state_dict` + first batch, median of "
        f"{len(r['fresh']['exact'])} (in parentheses: over a fresh start of the same loader).", "",
        f"| resume | fresh start (s) | {head} |", "|---" * (2 + len(POSITIONS)) + "|",
    ]
    worst = 0.0
    for name, case in CASES.items():
        fresh = med(r["fresh"][name])
        cells = []
        for f in POSITIONS:
            t = med(r["resume"][name, f])
            cells.append(f"{t:.3f} s ({t / fresh:.2f}x)")
            if name.startswith("elastic"):
                worst = max(worst, t / fresh)
        topo = f"{case['world']} rank(s) x {max(case['workers'], 1)} worker(s), batch {case['batch']}"
        lines.append(f"| {name} ({topo}) | {fresh:.3f} | " + " | ".join(cells) + " |")
    lines += ["", f"Elastic resume, worst position: {worst:.2f}x a fresh start (target <= {TARGET:.0f}x: "
              f"{'PASS' if worst <= TARGET else 'FAIL'})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=50e6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join("docs", "benchmarks.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    command = "python tools/bench_resume.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = bp.ensure_corpus(os.path.join(bp.ROOT, "bench-out", "pipeline", f"t{args.tokens}"), args.tokens)
    text = section(measure(meta["url"], args.repeats), meta, command.strip())
    print(text)
    if not args.no_write:
        from _benchdoc import publish

        publish("resume-elastic", text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
