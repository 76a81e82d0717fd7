"""The command line of tools/bench_peers.py: measure the peers at each corpus size (and publish
their section of docs/benchmarks.md), then streamforge's growth curves; or write the peers
section again from the last run's saved results."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from .corpus import ensure_flat
from .growth import growth_section, measure_growth, plot_growth
from .child import child_main
from .measure import ensure_formats, measure_sizes, package_versions, systems_at
from .report import peers_section, plot_peers
from .settings import BACKENDS, BANDWIDTH_MBPS, BATCH, BLOCK, LATENCY_MS, M, ROOT, SYSTEMS


def parse_args(argv, description: str = ""):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tokens", type=float, nargs="+", default=[50e6, 500e6],
                   help="corpus sizes; the table is the largest, each other is compared with it "
                        "(start-up against steady state); default 50e6 500e6")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--large-systems", nargs="+", choices=SYSTEMS,
                   help="systems measured at the sizes above the smallest (default: all of --systems)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS,
                   help="local disk; loopback S3 (moto, through a proxy that only counts); S3 through a proxy "
                        "adding --latency-ms to each response and capping each connection at --bandwidth-mbps")
    p.add_argument("--latency-ms", type=float, default=LATENCY_MS, help="time to first byte of s3-latency")
    p.add_argument("--bandwidth-mbps", type=float, default=BANDWIDTH_MBPS,
                   help="MB/s per connection of s3-latency")
    p.add_argument("--resume-workers", type=int, default=2)
    p.add_argument("--resume-check", type=int, default=32, help="batches compared after each resume")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--no-growth", action="store_true", help="skip streamforge's growth curves")
    p.add_argument("--only-growth", action="store_true", help="only streamforge's growth curves")
    p.add_argument("--growth-tokens", type=float, default=20e6, help="corpus of the growth curves")
    p.add_argument("--growth-repeats", type=int, default=3)
    p.add_argument("--growth-max-shards", type=int, default=100000,
                   help="largest manifest of the first-batch curve (default 100000; writing it takes minutes)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for one child process")
    p.add_argument("--out", default=os.path.join("docs", "benchmarks.md"))
    p.add_argument("--workdir", default=os.path.join(ROOT, "bench-out", "peers"))
    p.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    p.add_argument("--report-only", action="store_true",
                   help="write the peers section again from the last run's results (last-run.json), measuring nothing")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tokens = sorted(int(t) for t in args.tokens)
    if min(args.tokens) < BATCH * BLOCK * 20:
        p.error(f"--tokens must be >= {BATCH * BLOCK * 20}")
    return args


def main(argv=None, description: str = "") -> int:
    args = parse_args(argv, description)
    if args.child:
        with open(args.child) as f:
            child_main(json.load(f))
        return 0
    command = "python tools/bench_peers.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.report_only:
        return report_only(args)
    if not args.only_growth:
        run_peers(args, command.strip())
    if not args.no_growth:
        run_growth(args, command.strip())
    return 0


def run_peers(args, command: str) -> None:
    """Each corpus size's copies, cases and resume; the results saved (last-run.json) and published."""
    metas = {}
    for tokens in args.tokens:
        meta = ensure_flat(os.path.join(args.workdir, f"t{tokens}"), tokens)
        print(f"corpus t{tokens}: {meta['documents']:,} documents, {meta['tokens']:,} tokens", flush=True)
        ensure_formats(meta, systems_at(args, tokens), args.timeout)
        metas[tokens] = meta
    results = measure_sizes(metas, args)
    run = {"command": command, "versions": package_versions(), "date": datetime.date.today().isoformat(),
           "load": ", ".join(f"{x:.1f}" for x in os.getloadavg()), "args": vars(args)}
    dump = {"metas": {str(t): m for t, m in metas.items()}, "results": {str(t): encode(r) for t, r in results.items()},
            "run": run}
    with open(os.path.join(args.workdir, "last-run.json"), "w") as f:
        json.dump(dump, f, indent=1)
    publish_peers(results, metas, args, run)


def run_growth(args, command: str) -> None:
    g = measure_growth(args)
    text = growth_section(g, args, command)
    print(text)
    if not args.no_write:
        from _benchdoc import publish

        publish("growth", text, args.out, lambda path: plot_growth(g, path), "growth.png")


def publish_peers(results: dict, metas: dict, args, run: dict) -> None:
    text = peers_section(results, metas, args, run)
    print(text)
    if not args.no_write:
        from _benchdoc import publish

        title = f"One pass of {BATCH}x{BLOCK} blocks, {min(results) / M:g}M tokens"
        publish("peers", text, args.out, lambda path: plot_peers(results[min(results)], path, title, args),
                "peers_throughput.png")


def report_only(args) -> int:
    """Write the peers section again from the last run's results (``last-run.json``), with that
    run's command, settings, versions and date: a change to the report without a rerun."""
    with open(os.path.join(args.workdir, "last-run.json")) as f:
        dump = json.load(f)
    run = dump.get("run")
    if run is None:  # a run from before the run was saved: its settings as given now
        run = {"command": "python tools/bench_peers.py " + " ".join(a for a in sys.argv[1:] if a != "--report-only"),
               "versions": package_versions(), "date": datetime.date.today().isoformat(),
               "load": ", ".join(f"{x:.1f}" for x in os.getloadavg()), "args": vars(args)}
    for key in ("systems", "large_systems", "workers", "backends", "repeats", "resume_workers", "resume_check",
                "latency_ms", "bandwidth_mbps"):
        if key in run["args"]:
            setattr(args, key, run["args"][key])
    args.tokens = sorted(int(t) for t in dump["results"])
    metas = {int(t): m for t, m in dump["metas"].items()}
    results = {int(t): decode(r) for t, r in dump["results"].items()}
    publish_peers(results, metas, args, run)
    return 0


def decode(res: dict) -> dict:
    """A size's results from JSON: 'system|workers|backend' keys back to tuples."""
    def key(text: str) -> tuple:
        system, workers, backend = text.split("|")
        return system, int(workers), backend

    return {"runs": {key(k): v for k, v in res["runs"].items()}, "errors": {key(k): v for k, v in res["errors"].items()},
            "resume": res["resume"]}


def encode(obj):
    """JSON-able copy: tuple keys as 'system|workers|backend'."""
    if isinstance(obj, dict):
        return {("|".join(map(str, k)) if isinstance(k, tuple) else str(k)): encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    return obj
