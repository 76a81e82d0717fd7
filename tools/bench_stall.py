"""Data stall as a trainer feels it: how long the training thread waits for each batch.

The simulated trainer takes a batch, then "trains" for a fixed step time with ``time.sleep``,
which releases the GIL as a Python thread waiting on a CUDA step does. For each step time
(5, 20, 100 ms), loader mode and storage backend it reports the fraction of wall time spent
waiting in ``next(loader)`` and the p50 / p99 / max wait per step. The first batches
(``--warmup``, start-up: worker processes, manifests, first fetches) are left out and reported
apart.

Modes: ``0 workers`` (the pipeline runs on the training thread), ``0 workers + thread``
(``device_prefetch=2``: the pipeline runs on the loader's background thread), ``2 workers``
(DataLoader processes; the training thread receives and expands each batch) and ``2 workers +
thread`` (the loader's thread receives and expands them: what a CUDA rank gets by default). Backends: local disk; loopback S3 (moto) in a child process; the same
S3 behind ``tests/helpers/fault_proxy.py`` failing 5% of the reads (resets, 503 SlowDown, stalls,
truncated bodies), also in that child process so the trainer's process only runs the trainer;
with ``--latency-ms``, the same S3 behind ``tools/peers/latency_proxy.py`` (in that child too),
which waits that long before each response and caps each connection at ``--bandwidth-mbps``
(S3 in a region: 10-30 ms to the first byte, about 100 MB/s a connection).

    python tools/bench_stall.py            # about 4 minutes on 2 cores; writes docs/benchmarks.md
    python tools/bench_stall.py --latency-ms 25 --bandwidth-mbps 100   # adds the S3-with-latency rows
    python tools/bench_stall.py --quick    # a shorter smoke run, no doc update
    python tools/bench_stall.py --quick --backends latency --modes "2 workers" --steps 20  # one case
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from streamforge import PackedTokenDataset, Stream, StreamingLoader  # noqa: E402
from streamforge.demo.run import STREAMS, build_corpus  # noqa: E402
from streamforge.storage.config import RetryPolicy, StorageConfig  # noqa: E402

_SERVERS = """
import sys
# the checkout, its tests/ for helpers.fault_proxy and tools/ for peers.latency_proxy
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests", sys.argv[1] + "/tools"]
from streamforge.demo.s3 import LoopbackS3
from helpers.fault_proxy import FaultProxy
from peers.latency_proxy import LatencyProxy
s3 = LoopbackS3(key="bench", secret="bench").start()
proxy = FaultProxy(s3.endpoint_url, rate=float(sys.argv[2]), seed=0, stall_s=2.0).start()
slow = LatencyProxy(s3.endpoint_url, delay_ms=float(sys.argv[3]), bandwidth_mbps=float(sys.argv[4])).start()
print(s3.endpoint_url, proxy.endpoint_url, slow.endpoint_url, flush=True)
sys.stdin.read()
counts = slow.counts()
print(proxy.requests, sum(proxy.faults.values()), counts["requests"], counts["bytes"], flush=True)
slow.stop()
proxy.stop()
s3.stop()
"""

BACKENDS = ("floor", "local", "s3", "faults", "latency")
MODES = (("0 workers", 0, 0), ("0 workers + thread", 0, 2), ("2 workers", 2, 0), ("2 workers + thread", 2, 2))
STEP_MS = (5, 20, 100)


class Servers:
    """moto S3 (``streamforge.demo.s3.LoopbackS3``), the fault proxy and the latency proxy in
    front of it, in a child process (ended through its stdin, then by its pid)."""

    def __init__(self, fault_rate: float, latency_ms: float = 0.0, bandwidth_mbps: float = 0.0) -> None:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVERS, str(ROOT), str(fault_rate), str(latency_ms), str(bandwidth_mbps)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
        )
        self.clean, self.faulty, self.slow = self.proc.stdout.readline().split()

    def options(self, endpoint: str) -> dict:
        return {"key": "bench", "secret": "bench", "skip_instance_cache": True,
                "client_kwargs": {"endpoint_url": endpoint}}

    def stop(self) -> tuple[int, int, int, int]:
        """(fault proxy: requests, faults; latency proxy: requests, body bytes)."""
        try:
            out, _ = self.proc.communicate("", timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return 0, 0, 0, 0
        requests, faults, slow_requests, slow_bytes = (int(x) for x in out.split())
        return requests, faults, slow_requests, slow_bytes


def upload(local: Path, opts: dict) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir("stall")
    for spec in STREAMS:
        fs.put(str(local / spec.name) + "/", f"stall/{spec.name}/", recursive=True)


def make_loader(urls: dict[str, str], opts: dict | None, num_workers: int, depth: int, args) -> StreamingLoader:
    storage = StorageConfig(retry=RetryPolicy(timeout=1.0, backoff_base=0.02, backoff_max=0.5))
    streams = [Stream(urls[s.name], weight=s.weight, name=s.name, storage_options=opts) for s in STREAMS]
    dataset = PackedTokenDataset(streams, seq_len=args.seq_len, seed=0, shuffle_buffer=4096, packing="concat",
                                 eos_id=511, infinite=True, storage=storage)
    return StreamingLoader(dataset, batch_size=args.batch_size, num_workers=num_workers, device="cpu",
                           device_prefetch=depth)


class ReadyBatches:
    """The floor: batches made beforehand, handed out by a plain iterator. Its waits are
    what this machine charges for any ``next()`` right after the trainer slept (a core woken
    from idle, cold caches), whatever the loader."""

    def __init__(self, loader: StreamingLoader) -> None:
        it = iter(loader)
        self.batches = [next(it) for _ in range(16)]
        del it

    def __iter__(self):
        return itertools.cycle(self.batches)


def storage_counts(loader) -> dict[str, int]:
    if not isinstance(loader, StreamingLoader):
        return {"retries": 0, "hedged": 0}
    streams = loader.stats()["streams"].values()
    return {k: int(sum(s.get(k, 0) for s in streams)) for k in ("retries", "hedged")}


def measure(loader, args) -> tuple[float, list[dict]]:
    """(start-up seconds, one row per step time)."""
    it = iter(loader)
    start = time.perf_counter()
    for _ in range(args.warmup):
        next(it)
        time.sleep(0.02)
    startup = time.perf_counter() - start
    rows = []
    for step_ms in args.steps:
        steps = max(20, min(args.max_steps, int(args.seconds * 1000 / step_ms)))
        waits = np.zeros(steps)
        begin = time.perf_counter()
        for i in range(steps):
            t0 = time.perf_counter()
            next(it)
            waits[i] = time.perf_counter() - t0
            time.sleep(step_ms / 1000)
        wall = time.perf_counter() - begin
        rows.append({"step_ms": step_ms, "steps": steps, "stall": waits.sum() / wall,
                     "p50": np.percentile(waits, 50) * 1e3, "p99": np.percentile(waits, 99) * 1e3,
                     "max": waits.max() * 1e3})
    del it
    counts = storage_counts(loader)
    for row in rows:
        row.update(counts)
    return startup, rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-out/stall"))
    p.add_argument("--tokens", type=int, default=4_000_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seconds", type=float, default=2.5, help="per step time (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--fault-rate", type=float, default=0.05)
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="add S3 read through tools/peers/latency_proxy.py, this long to each response's first byte")
    p.add_argument("--bandwidth-mbps", type=float, default=100.0,
                   help="with --latency-ms: MB/s per connection (default: %(default)s)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, help="storage to measure (default: all of "
                   "floor, local, s3, faults, and latency with --latency-ms)")
    p.add_argument("--modes", nargs="+", choices=[m[0] for m in MODES], help="loader modes (default: all)")
    p.add_argument("--steps", nargs="+", type=int, default=list(STEP_MS), help="step times, ms (default: 5 20 100)")
    p.add_argument("--quick", action="store_true", help="short run, no doc update")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    args.command = " ".join(["python tools/bench_stall.py", *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.seconds, args.tokens = 0.5, 1_000_000
    if args.backends is None:
        args.backends = [b for b in BACKENDS if b != "latency" or args.latency_ms > 0]
    if "latency" in args.backends and args.latency_ms <= 0:
        p.error("the latency backend needs --latency-ms")
    modes = [m for m in MODES if args.modes is None or m[0] in args.modes]
    local = args.out.resolve() / "corpus"
    build_corpus(local, args.tokens, seed=0)
    servers = Servers(args.fault_rate, args.latency_ms, args.bandwidth_mbps)
    results = []
    try:
        upload(local, servers.options(servers.clean))
        s3_urls = {s.name: f"s3://stall/{s.name}" for s in STREAMS}
        backends = (
            ("local", "local", {s.name: str(local / s.name) for s in STREAMS}, None),
            ("s3", "S3", s3_urls, servers.options(servers.clean)),
            ("faults", f"S3, {args.fault_rate:.0%} faults", s3_urls, servers.options(servers.faulty)),
            ("latency", latency_name(args), s3_urls, servers.options(servers.slow)),
        )
        runs = []
        if "floor" in args.backends:
            floor = ReadyBatches(make_loader(backends[0][2], None, 0, 0, args))
            runs.append(("none", "floor: ready batches", lambda: floor))
        runs += [(backend, mode, lambda u=urls, o=opts, w=workers, d=depth: make_loader(u, o, w, d, args))
                 for key, backend, urls, opts in backends if key in args.backends for mode, workers, depth in modes]
        for backend, mode, make in runs:
            startup, rows = measure(make(), args)
            for row in rows:
                row.update(backend=backend, mode=mode, startup=startup)
                results.append(row)
                print(f"{backend:<16} {mode:<20} {row['step_ms']:>4} ms: stall {row['stall']:6.2%}  "
                      f"p50 {row['p50']:6.2f}  p99 {row['p99']:7.2f}  max {row['max']:7.2f} ms "
                      f"(start-up {startup:.2f} s, retries {row['retries']}, hedged {row['hedged']})",
                      flush=True)
    finally:
        requests, faults, slow_requests, slow_bytes = servers.stop()
    print(f"fault proxy: {faults} of {requests} requests faulted")
    if "latency" in args.backends:
        print(f"latency proxy: {slow_requests} requests, {slow_bytes / 1e6:.1f} MB")
        for line in stall_target(results, args):
            print(line)
    if not (args.quick or args.no_write):
        write_doc(results, args, requests, faults)
    return 0


def latency_name(args) -> str:
    return f"S3, {args.latency_ms:g} ms + {args.bandwidth_mbps:g} MB/s"


def stall_target(results: list[dict], args) -> list[str]:
    """Issue #39's stall target: at 20 ms steps through the latency proxy with 2 workers, < 1%
    stall and no wait over 100 ms (each 2-worker mode measured)."""
    out = []
    for r in results:
        if r["backend"] == latency_name(args) and r["step_ms"] == 20 and r["mode"].startswith("2 workers"):
            ok = r["stall"] < 0.01 and r["max"] <= 100
            out.append(f"Target (20 ms steps, {r['backend']}, {r['mode']}): < 1% stall and no wait over 100 ms: "
                       f"{r['stall']:.2%} stall, longest wait {r['max']:.1f} ms: {'met' if ok else '**missed**'}.")
    return out


def write_doc(results: list[dict], args, requests: int, faults: int) -> None:
    from _benchdoc import update_section

    img = ROOT / "docs" / "img" / "stall.png"
    plot(results, img)
    lines = [
        "## Data stall: what the training thread waits for (`tools/bench_stall.py`)",
        "",
        f"`{args.command}`, {date.today()}, {platform.machine()} with {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}. Three streams (the demo's corpus, {args.tokens / 1e6:.0f}M tokens), "
        f"seq_len {args.seq_len}, batch {args.batch_size} ({args.seq_len * args.batch_size:,} tokens a step), "
        "CPU batches. The trainer takes a batch, then sleeps for the step time (the GIL is free, as "
        f"while a GPU step runs). {args.warmup} start-up batches are left out (start-up column). S3 is moto "
        f"on 127.0.0.1 in a child process; the faulty S3 is the same server behind `tests/helpers/fault_proxy.py` "
        f"({faults} of {requests} requests faulted: resets, 503 SlowDown, 2 s stalls, truncated bodies), "
        "with a 1 s request timeout; reads that run far past their peers are hedged (a twin request, "
        "`StorageConfig.hedge`; the hedged column counts them)."
        + (f" {latency_name(args)}: the same server behind `tools/peers/latency_proxy.py`, which waits "
           f"{args.latency_ms:g} ms before each response (time to first byte) and sends each connection's bodies "
           f"no faster than {args.bandwidth_mbps:g} MB/s." if "latency" in args.backends else ""),
        "",
        *(line for t in stall_target(results, args) for line in (t, "")),
        "The first rows are the floor: the same trainer over 16 batches made beforehand and handed out by a "
        "plain Python iterator. On this machine the first code and data touched after the trainer slept run "
        "far slower than warm ones (right after a 20 ms sleep: an empty Python call 16 us, a `queue.Queue.get` "
        "78 us, a numpy add of 3 numbers 68 us), so what the loader does on the training thread between two "
        "steps is kept to one lock-free hand-off and a few additions.",
        "",
        "![stall per configuration](img/stall.png)",
        "",
        "| backend | loader | step | stall (share of wall time) | wait p50 (ms) | p99 (ms) | max (ms) | "
        "start-up (s) | retries | hedged |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['backend']} | {r['mode']} | {r['step_ms']} ms | {r['stall']:.2%} | {r['p50']:.2f} | "
                     f"{r['p99']:.2f} | {r['max']:.1f} | {r['startup']:.2f} | {r['retries']} | {r['hedged']} |")
    update_section("stall", "\n".join(lines))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys((r["backend"], r["mode"]) for r in results))
    fig, ax = plt.subplots(figsize=(13, 4.2))
    steps = sorted({r["step_ms"] for r in results})
    width = 0.8 / len(steps)
    for i, step_ms in enumerate(steps):
        values = [next(r["stall"] for r in results if (r["backend"], r["mode"]) == c and r["step_ms"] == step_ms)
                  for c in configs]
        ax.bar([j + (i - (len(steps) - 1) / 2) * width for j in range(len(configs))], [v * 100 for v in values], width,
               label=f"{step_ms} ms steps")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(configs)), [f"{b}\n{m.replace(' + ', chr(10) + '+ ')}" for b, m in configs],
                  fontsize="x-small")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylabel("time waiting for data (%)")
    ax.set_title("data stall per step time (dashed: 1%)")
    ax.legend(fontsize="small")
    from _benchdoc import save_figure

    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
