"""Object-store requests and bytes a job makes before its first batch, per rank and in all.

    python tools/bench_startup.py [--ranks 1,2,4,8] [--workers 0] [--modes shared,alone]
                                  [--out docs/benchmarks.md] [--no-write]

Real processes on real storage: a loopback S3 server (moto, ``streamforge.demo.s3``) holds a
three-stream corpus of small shards written by ``ShardWriter``; each rank of a ``torchrun`` job
(CPU, gloo; ``tests/helpers/workers/startup_worker.py``) reads it through a counting HTTP
proxy of its own (``tests/helpers/fault_proxy.py`` with no faults), builds its dataset and
loader, takes its first batch, and marks its proxy's log. What was asked before the mark is
sorted by object and byte range: the manifests (``index.json``), record indexes (a range at
the shard's index offset) and data frames.

Modes: ``shared`` is the loader as it is (the ranks plan a pass together, each reading only
its own cuts' record indexes); ``alone`` makes each rank compute the plan on its own first
(``loader.plan()`` before iterating: the index of every shard any cut falls in), as every rank
did before. The section ``startup`` of docs/benchmarks.md gets the table; the same counts at
64 ranks and up, from the planner, are in the ``plan-scale`` section (``bench_plan_scale.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tools")]

import numpy as np  # noqa: E402

from helpers.fault_proxy import FaultProxy  # noqa: E402
from streamforge import ShardWriter  # noqa: E402
from streamforge.demo.s3 import LoopbackS3, free_port  # noqa: E402
from streamforge.format.manifest import Manifest  # noqa: E402

WORKER = ROOT / "tests" / "helpers" / "workers" / "startup_worker.py"
NAMES = ("web", "code", "books")
SHARDS = (48, 24, 12)  # shards per stream
MEDIANS = (300, 600, 3000)  # lognormal median document length, tokens
DOCS_PER_SHARD = (40, 20, 4)


def write_corpus(s3: LoopbackS3, bucket: str, seed: int = 0) -> list[str]:
    """Three streams of small shards on the server; returns their URLs."""
    s3.create_bucket(bucket)
    rng = np.random.default_rng(seed)
    urls = []
    for name, shards, median, per_shard in zip(NAMES, SHARDS, MEDIANS, DOCS_PER_SHARD):
        url = f"s3://{bucket}/{name}"
        lengths = np.maximum(1, rng.lognormal(np.log(median), 1.0, shards * per_shard)).astype(int)
        shard_bytes = int(2 * lengths.sum() / shards)
        with ShardWriter(url, shard_size=shard_bytes, frame_size="4KiB", eos_id=0,
                         storage_options=s3.storage_options()) as writer:
            for n in lengths:
                writer.write(rng.integers(1, 1000, size=int(n)).astype(np.uint16))
        urls.append(url)
    return urls


def classify(log, manifests: dict[str, Manifest], mark: int) -> dict:
    """Requests and response bytes before ``mark``, sorted into manifests, record indexes and
    data; with the distinct shards whose data was read."""
    out = {"manifest": [0, 0], "index": [0, 0], "data": [0, 0], "other": [0, 0], "shards_read": set(),
           "index_shards": set()}
    for method, path, range_, nbytes, _status in log[:mark]:
        parts = path.split("?")[0].strip("/").split("/")
        kind = "other"
        if parts[-1] == "index.json":
            kind = "manifest"
        elif len(parts) >= 3 and parts[-2] in manifests and parts[-1].startswith("shard-"):
            m = manifests[parts[-2]]
            shard = int(re.findall(r"\d+", parts[-1])[0])
            start = int(re.match(r"bytes=(\d+)", range_).group(1)) if range_ else 0
            kind = "index" if start >= int(m.columns["index_offset"][shard]) else "data"
            out["shards_read" if kind == "data" else "index_shards"].add((parts[-2], shard))
        out[kind][0] += 1
        out[kind][1] += nbytes
    return out


def run_job(s3: LoopbackS3, urls: list[str], ranks: int, *, workers: int = 0, alone: bool = False,
            seq_len: int = 256, batch_size: int = 4, prefetch_bytes: int | None = 0, timeout: float = 600) -> dict:
    """One ``torchrun`` job of ``ranks`` processes to its first batch; per rank: seconds,
    requests and bytes by kind, and the plan's steps (every rank's must agree)."""
    manifests = {u.rsplit("/", 1)[1]: Manifest.load(u, s3.storage_options()) for u in urls}
    proxies = [FaultProxy(s3.endpoint_url, rate=0.0).start() for _ in range(ranks)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "config.json"
            config.write_text(json.dumps({
                "urls": urls, "endpoints": [p.endpoint_url for p in proxies], "key": s3.key, "secret": s3.secret,
                "workers": workers, "seq_len": seq_len, "batch_size": batch_size, "alone": alone,
                "prefetch_bytes": prefetch_bytes}))
            env = {**os.environ, **s3.env(),
                   "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
            env.pop("CUDA_VISIBLE_DEVICES", None)
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(WORKER), str(config), tmp]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"the {ranks}-rank job failed:\n{proc.stderr[-4000:]}")
            results = [json.loads((Path(tmp) / f"rank-{r}.json").read_text()) for r in range(ranks)]
    finally:
        for p in proxies:
            p.stop()
    per_rank = []
    names = [u.rsplit("/", 1)[1] for u in urls]
    for r, (res, proxy) in enumerate(zip(results, proxies)):
        counts = classify(proxy.log, manifests, res["mark"])
        own = {name: set(shards) for name, shards in zip(names, res["own_shards"])}
        per_rank.append({"rank": r, "seconds": res["seconds"], "steps": res["steps"],
                         **{k: counts[k] for k in ("manifest", "index", "data", "other")},
                         "shards_read": len(counts["shards_read"]),
                         # record indexes read of shards outside this rank's own ranges (the
                         # shards its own cuts fall in, at most one a stream)
                         "foreign_indexes": len({(u, s) for u, s in counts["index_shards"]
                                                 if s not in own.get(u, ())}),
                         "index_shards": len(counts["index_shards"])})
    return {"ranks": ranks, "workers": workers, "alone": alone, "per_rank": per_rank, "prefetch_bytes": prefetch_bytes,
            "shards": {k: m.num_shards for k, m in manifests.items()},
            "steps_agree": len({r["steps"] for r in per_rank}) == 1}


def totals(job: dict) -> dict:
    """The job's requests and bytes by kind, summed over ranks, and the per-rank maximum."""
    rows = job["per_rank"]
    out = {k: [sum(r[k][0] for r in rows), sum(r[k][1] for r in rows)] for k in ("manifest", "index", "data", "other")}
    out["requests"] = sum(v[0] for v in out.values())
    out["bytes"] = sum(v[1] for k, v in out.items() if k in ("manifest", "index", "data", "other"))
    out["max_rank_requests"] = max(sum(r[k][0] for k in ("manifest", "index", "data", "other")) for r in rows)
    out["max_rank_index"] = max(r["index"][0] for r in rows)
    out["shards_read"] = sum(r["shards_read"] for r in rows)
    out["seconds"] = max(r["seconds"] for r in rows)
    return out


def table(jobs: list[dict]) -> list[str]:
    lines = ["| mode | ranks | manifest GETs (all ranks) | index GETs: all / most on a rank | data GETs | "
             "shards whose data was read | requests in all | per rank | MiB in all | first batch, s (slowest rank) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for job in jobs:
        t = totals(job)
        lines.append(
            f"| {'alone' if job['alone'] else 'shared'} | {job['ranks']} | {t['manifest'][0]} | {t['index'][0]} / "
            f"{t['max_rank_index']} | {t['data'][0]} | {t['shards_read']} | {t['requests']} | "
            f"{t['requests'] / job['ranks']:.1f} | {t['bytes'] / 2**20:.2f} | {t['seconds']:.2f} |")
    return lines


def section(jobs: list[dict], command: str) -> str:
    corpus = ", ".join(f"{n}: {s} shards" for n, s in jobs[0]["shards"].items())
    load = os.getloadavg()[0]
    return "\n".join([
        "## Start-up requests: what a job asks of object storage before its first batch (`tools/bench_startup.py`)",
        "",
        f"`{command}`, {datetime.date.today().isoformat()}, {platform.machine()} with {os.cpu_count()} CPUs "
        f"(shared; load average {load:.1f} at the end), Python {platform.python_version()}.",
        "",
        f"A `torchrun` job (CPU, gloo) per row, one process a rank, `num_workers={jobs[0]['workers']}`, batch 4 x 256, "
        f"`prefetch_bytes={jobs[0]['prefetch_bytes']}` (what the first batch needs, without the read-ahead, which adds "
        "up to its budget a rank whatever the number of ranks), "
        f"over a loopback S3 server (moto) holding three streams of small shards ({corpus}). Each rank reads "
        "through a counting proxy of its own; the counts are what its proxy had answered when the rank held its "
        "first batch (read-ahead still in flight is not counted). *shared*: the loader as it is (rank 0 reads the "
        "manifests and broadcasts them; the ranks plan the pass together, each reading the record indexes of its "
        "own cuts only). *alone*: each rank computes the plan on its own first (the index of every shard any cut "
        "falls in), as every rank did before.",
        "",
        *table(jobs),
        "",
        *notes(jobs),
    ])


def notes(jobs: list[dict]) -> list[str]:
    shared = {j["ranks"]: totals(j) for j in jobs if not j["alone"]}
    alone = {j["ranks"]: totals(j) for j in jobs if j["alone"]}
    out = []
    if shared:
        top = max(shared)
        out.append(f"Shared, 1 -> {top} ranks: manifest GETs {shared[min(shared)]['manifest'][0]} -> "
                   f"{shared[top]['manifest'][0]} (read once, by rank 0); the most index GETs on one rank "
                   f"{shared[min(shared)]['max_rank_index']} -> {shared[top]['max_rank_index']}; requests in all "
                   f"{shared[min(shared)]['requests']} -> {shared[top]['requests']} while the shards read before "
                   f"the first batch went {shared[min(shared)]['shards_read']} -> {shared[top]['shards_read']}.")
    both = sorted(set(shared) & set(alone))
    if both:
        r = both[-1]
        out.append(f"At {r} ranks, alone against shared: index GETs {alone[r]['index'][0]} against "
                   f"{shared[r]['index'][0]} ({alone[r]['max_rank_index']} against {shared[r]['max_rank_index']} on "
                   "the busiest rank); alone, every rank reads the index of every shard a cut falls in, so the "
                   "total grows as ranks x cuts.")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--workers", type=int, default=0, help="num_workers of each rank's loader")
    parser.add_argument("--modes", default="shared,alone")
    parser.add_argument("--prefetch-bytes", type=int, default=0, help="StorageConfig.prefetch_bytes (-1: default)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    command = "python tools/bench_startup.py" + ("" if not (argv if argv is not None else sys.argv[1:]) else
                                                  " " + " ".join(argv if argv is not None else sys.argv[1:]))
    jobs = []
    with LoopbackS3(in_process=False) as s3:
        urls = write_corpus(s3, "startup")
        for mode in args.modes.split(","):
            for ranks in [int(x) for x in args.ranks.split(",")]:
                job = run_job(s3, urls, ranks, workers=args.workers, alone=mode == "alone",
                              prefetch_bytes=None if args.prefetch_bytes < 0 else args.prefetch_bytes)
                jobs.append(job)
                print(table([job])[-1], flush=True)
    text = section(jobs, command)
    print(text)
    if not args.no_write:
        from _benchdoc import update_section

        update_section("startup", text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
