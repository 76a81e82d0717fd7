"""What ``StreamingLoader(read_once=True)`` saves in a hybrid-parallel job, per process.

    python tools/bench_read_once.py [--steps 150] [--repeats 3] [--storage s3|local]
                                    [--tokens 3e6] [--out docs/benchmarks.md] [--no-write]

The job: ``torchrun --nproc_per_node 4`` (gloo, CPU, 127.0.0.1) on a ``DeviceMesh`` of
("dp", "tp") = (2, 2), so each data-parallel rank has two processes (replica 0 and replica 1,
its tensor-parallel peers) that get the same batches. Every process builds
``PackedTokenDataset(..., mesh=mesh)`` and ``StreamingLoader(num_workers=1, device="cpu")``,
once as is (``default``: every process runs its own pipeline in its own worker process)
and once with ``read_once=True`` (replica 0 runs the pipeline and broadcasts each compact
batch over its replica group; replica 1 starts no worker and reads nothing).

Measured in each process (``--worker`` mode of this file, which torchrun runs):

* bytes its pipelines fetched from storage: ``stats()["streams"][name]["bytes_fetched"]``
  summed over the streams, and apart from them the record-index bytes the planner read to
  cut the pass (``src.stats()["bytes_fetched"]`` over ``dataset._index_sources``);
* CPU seconds (user + system) of the process and of its DataLoader worker process, from
  just before the dataset is built to after the loader's workers have been joined:
  ``resource.getrusage`` of ``RUSAGE_SELF`` plus ``RUSAGE_CHILDREN`` (a child's time counts
  once it has been reaped). Interpreter start-up, ``import torch`` and the process group's
  set-up are left out. Shown apart: the set-up (the process's CPU before the loop: dataset,
  loader, the pass's plan) and the worker process's share;
* the stall: the seconds the training loop spent inside ``next(iterator)`` while each step
  "trains" with ``time.sleep(--step-ms)``: in total over ``--steps`` steps (the first batch,
  start-up, included), as the median step, and the first batch's wait apart; and steps per
  second over the loop.

The corpus (two streams of lognormal documents, random uint16 ids, written with
``ShardWriter`` into a temporary directory) is served by default from a moto S3 server on
127.0.0.1 in a child process of this tool (``streamforge.demo.s3.LoopbackS3``), as object
storage would serve it; ``--storage local`` reads the files directly. Each variant is one
torchrun per repeat, the two alternating in order from one repeat to the next; the table
holds the median over repeats of every process's figures, and the summary the median per
role (reader: replica 0; replica: replica 1) over data-parallel ranks and repeats, with the
ratio read_once / default. The figures go to the ``read-once`` section of
docs/benchmarks.md unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

DP, TP = 2, 2
VARIANTS = ("default", "read_once")
# name, mixture weight, median document length (tokens)
STREAMS = (("web", 0.7, 300), ("code", 0.3, 1200))
VOCAB = 32000
EOS = 0
BUCKET = "readonce"


# -- the corpus and where it is served from -----------------------------------------------------
def build_corpus(root: Path, tokens: int, seed: int = 0) -> dict[str, Path]:
    """Two streams of about ``tokens`` tokens in all, split by weight; their local paths."""
    import numpy as np

    from streamforge import ShardWriter

    rng = np.random.default_rng(seed)
    paths = {}
    for name, weight, median in STREAMS:
        paths[name] = root / name
        left = int(tokens * weight)
        with ShardWriter(str(paths[name]), shard_size="256KiB", frame_size="32KiB", eos_id=EOS) as writer:
            while left > 0:
                n = max(1, min(left, int(rng.lognormal(np.log(median), 1.0))))
                writer.write(rng.integers(1, VOCAB, size=n).astype(np.uint16))
                left -= n
    return paths


class Storage:
    """Where the workers read the corpus: the local paths, or a loopback S3 server (in a
    child process, so its CPU is nobody's figure) holding a copy."""

    def __init__(self, kind: str, paths: dict[str, Path]) -> None:
        self.kind, self.s3 = kind, None
        self.urls = {name: str(path) for name, path in paths.items()}
        self.options: dict | None = None
        self.env: dict[str, str] = {}
        if kind == "s3":
            from streamforge.demo.s3 import LoopbackS3

            self.s3 = LoopbackS3(key="bench", secret="bench", in_process=False).start()
            self.urls = {name: self.s3.upload(path, BUCKET, name) for name, path in paths.items()}
            self.options, self.env = self.s3.storage_options(), self.s3.env()

    def close(self) -> None:
        if self.s3 is not None:
            self.s3.stop()
            self.s3 = None


# -- one process of the job (torchrun runs this file with --worker) -----------------------------
def _cpu(who: int) -> float:
    """User + system seconds of ``resource.RUSAGE_SELF`` or ``RUSAGE_CHILDREN``."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _join_worker_processes(timeout: float = 30.0) -> int:
    """Wait until this process has no child left (the DataLoader workers joined and reaped,
    so their CPU time is in ``RUSAGE_CHILDREN``); returns how many were still alive."""
    import multiprocessing

    from streamforge.loader import workers

    workers._join_exits()  # an exit the loader left to a thread
    deadline = time.monotonic() + timeout
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(multiprocessing.active_children())


def worker(job_path: str, variant: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from streamforge import PackedTokenDataset, Stream, StreamingLoader

    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dist.barrier()

    cpu_self, cpu_children = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    streams = [Stream(job["urls"][name], weight=weight, name=name, storage_options=job["options"])
               for name, weight, _ in STREAMS]
    dataset = PackedTokenDataset(streams, seq_len=job["seq_len"], seed=0, mesh=mesh)
    loader = StreamingLoader(dataset, batch_size=job["batch_size"], num_workers=1, device="cpu",
                             read_once=variant == "read_once")
    steps = min(job["steps"], loader.steps_per_pass)  # the same on every process (the plan is cut here)
    setup_s = _cpu(resource.RUSAGE_SELF) - cpu_self  # no worker process runs yet
    topology = dataset.topology
    waits = []
    step_s = job["step_ms"] / 1000
    dist.barrier()  # every process starts its loop together
    it = iter(loader)
    begin = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(it)
        waits.append(time.perf_counter() - t0)
        time.sleep(step_s)  # the training step
    loop_s = time.perf_counter() - begin
    stats = loader.stats()
    fetched = sum(s.get("bytes_fetched", 0) for s in stats["streams"].values())
    index = sum(src.stats().get("bytes_fetched", 0) for src in dataset._index_sources.values())
    it.close()  # stops and joins the worker process
    del it, batch, loader, dataset
    alive = _join_worker_processes()
    cpu_self = _cpu(resource.RUSAGE_SELF) - cpu_self
    cpu_children = _cpu(resource.RUSAGE_CHILDREN) - cpu_children
    report = {
        "process": dist.get_rank(), "dp": topology.rank, "replica": topology.replica, "variant": variant,
        "steps": steps, "bytes_fetched": fetched, "index_bytes": index,
        "cpu_s": cpu_self + cpu_children, "cpu_self_s": cpu_self, "cpu_workers_s": cpu_children,
        "cpu_setup_s": setup_s,
        "workers_alive": alive, "stall_s": sum(waits), "stall_median_s": statistics.median(waits),
        "first_wait_s": waits[0], "steps_per_s": steps / loop_s,
    }
    Path(job["out"], f"{variant}-p{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


# -- the launcher ------------------------------------------------------------------------------
def launch(variant: str, job_path: Path, out: Path, storage: Storage, timeout: float) -> list[dict]:
    """One torchrun of the variant; every process's report, in process order."""
    from streamforge.demo.s3 import free_port

    for old in out.glob(f"{variant}-p*.json"):
        old.unlink()
    env = {**os.environ, **storage.env,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
           "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={DP * TP}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(Path(__file__).resolve()), "--worker", str(job_path), variant]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun of {variant} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"{variant}-p{p}.json").read_text()) for p in range(DP * TP)]


def role(replica: int) -> str:
    return "reader" if replica == 0 else "replica"


COLUMNS = (  # key, header, scale, format
    ("bytes_fetched", "pipeline fetched, MB", 1e6, "{:.2f}"),
    ("index_bytes", "index fetched, KB", 1e3, "{:.1f}"),
    ("cpu_s", "CPU s (process + worker)", 1, "{:.2f}"),
    ("cpu_setup_s", "of it set-up s", 1, "{:.2f}"),
    ("cpu_workers_s", "of it worker s", 1, "{:.2f}"),
    ("stall_s", "stall total s", 1, "{:.3f}"),
    ("stall_median_s", "stall median ms", 1e-3, "{:.2f}"),
    ("first_wait_s", "first batch s", 1, "{:.2f}"),
    ("steps_per_s", "steps/s", 1, "{:.1f}"),
)


def process_table(runs: dict[str, list[list[dict]]]) -> list[str]:
    """One row per variant and process: the median over repeats of each figure."""
    lines = ["| variant | dp rank | replica | role | " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|---|---|---|---|" + "---|" * len(COLUMNS)]
    for variant in VARIANTS:
        for p in range(DP * TP):
            reports = [repeat[p] for repeat in runs[variant]]
            first = reports[0]
            cells = [fmt.format(statistics.median(r[key] for r in reports) / scale) for key, _, scale, fmt in COLUMNS]
            lines.append(f"| {variant} | {first['dp']} | {first['replica']} | {role(first['replica'])} | "
                         + " | ".join(cells) + " |")
    return lines


SUMMARY = (  # the whole job's rows take the first four
    ("bytes_fetched", "pipeline fetched, MB", 1e6, "{:.2f}"), ("index_bytes", "index fetched, KB", 1e3, "{:.1f}"),
    ("cpu_s", "CPU s", 1, "{:.2f}"), ("cpu_workers_s", "of it worker process s", 1, "{:.2f}"),
    ("stall_s", "stall total s", 1, "{:.3f}"), ("stall_median_s", "stall median ms", 1e-3, "{:.2f}"),
    ("steps_per_s", "steps/s", 1, "{:.1f}"),
)


def summary(runs: dict[str, list[list[dict]]]) -> list[str]:
    """Per role, the median over data-parallel ranks and repeats of each figure in both
    variants and their ratio; then the job's totals (all four processes summed, median over
    repeats)."""
    lines = ["| who | figure | default | read_once | read_once / default |", "|---|---|---|---|---|"]

    def add(who: str, label: str, values: dict[str, float], scale: float, fmt: str) -> None:
        a, b = values["default"], values["read_once"]
        ratio = f"{b / a:.2f}" if a else "-"
        lines.append(f"| {who} | {label} | {fmt.format(a / scale)} | {fmt.format(b / scale)} | {ratio} |")

    for replica in range(TP):
        for key, label, scale, fmt in SUMMARY:
            values = {v: statistics.median(r[key] for repeat in runs[v] for r in repeat if r["replica"] == replica)
                      for v in VARIANTS}
            add(f"{role(replica)} (replica {replica})", label, values, scale, fmt)
    for key, label, scale, fmt in SUMMARY[:4]:
        values = {v: statistics.median(sum(r[key] for r in repeat) for repeat in runs[v]) for v in VARIANTS}
        add("whole job (4 processes)", label, values, scale, fmt)
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        worker(*argv[1:3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150, help="training steps per process (default: %(default)s)")
    p.add_argument("--step-ms", type=float, default=20.0, help="simulated step time (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--storage", choices=("s3", "local"), default="s3",
                   help="serve the corpus from a loopback S3 server (default) or local files")
    p.add_argument("--tokens", type=float, default=3e6, help="corpus size in tokens (default: %(default).0f)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--timeout", type=float, default=300, help="seconds per torchrun")
    p.add_argument("--out", default=None, help="the benchmarks document (default: docs/benchmarks.md)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    args = p.parse_args(argv)
    command = shlex.join(["python", "tools/bench_read_once.py", *argv])

    with tempfile.TemporaryDirectory(prefix="bench-read-once-") as tmp:
        tmp_path = Path(tmp)
        paths = build_corpus(tmp_path / "corpus", int(args.tokens))
        corpus_bytes = sum(f.stat().st_size for path in paths.values() for f in path.rglob("*") if f.is_file())
        storage = Storage(args.storage, paths)
        try:
            out = tmp_path / "out"
            out.mkdir()
            job_path = tmp_path / "job.json"
            job_path.write_text(json.dumps({
                "urls": storage.urls, "options": storage.options, "seq_len": args.seq_len,
                "batch_size": args.batch_size, "steps": args.steps, "step_ms": args.step_ms, "out": str(out)}))
            runs: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
            for repeat in range(args.repeats):
                order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    start = time.perf_counter()
                    reports = launch(variant, job_path, out, storage, args.timeout)
                    runs[variant].append(reports)
                    cpu = " ".join(f"{r['cpu_s']:.2f}" for r in reports)
                    print(f"repeat {repeat} {variant:<9}: {reports[0]['steps']} steps, CPU s by process {cpu}, "
                          f"{time.perf_counter() - start:.1f} s wall", flush=True)
        finally:
            storage.close()

    steps = runs["default"][0][0]["steps"]
    alive = sum(r["workers_alive"] for v in VARIANTS for repeat in runs[v] for r in repeat)
    table = process_table(runs)
    summary_lines = summary(runs)
    s3 = args.storage == "s3"
    where = "a moto S3 server on 127.0.0.1 (`streamforge.demo.s3.LoopbackS3`, its own process)" if s3 else "local files"
    if steps < args.steps:
        print(f"note: one pass holds {steps} steps per rank, fewer than --steps {args.steps}; use more --tokens")
    text = "\n".join([
        "## One read per replica group: `read_once=True` (`tools/bench_read_once.py`)",
        "",
        f"`{command}`, {datetime.date.today()}, {platform.machine()} with {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}. torchrun of {DP * TP} gloo processes on a DeviceMesh of "
        f"(\"dp\", \"tp\") = ({DP}, {TP}); each process: `StreamingLoader(num_workers=1, device=\"cpu\")`, "
        f"seq_len {args.seq_len}, batch {args.batch_size}, {steps} steps with a {args.step_ms:g} ms sleep "
        f"as the training step. Corpus: 2 streams (weights 0.7 / 0.3), {args.tokens / 1e6:g}M tokens, "
        f"{corpus_bytes / 1e6:.1f} MB of 256 KiB shards, served from {where}. "
        f"{args.repeats} run(s) per variant, the two alternating; medians.",
        "",
        f"The machine has {os.cpu_count()} cores: the 4 training processes, their DataLoader worker "
        f"processes (4 by default, 2 with read_once){' and the S3 server' if s3 else ''} share them, so CPU "
        "seconds are the figure to compare; stall and steps/s depend on who else was running and are noisy. "
        "CPU is user + system time of the process and its worker from building the dataset to the worker's "
        "exit (imports and process-group set-up left out); set-up is the process's part before the loop "
        "(dataset, loader, the pass's plan), worker the DataLoader worker process's. Pipeline bytes: "
        "`stats()` of the loader; index bytes: record indexes the planner read to cut the pass (every "
        "process plans, whatever `read_once`).",
        "",
        "Per process (median over runs):",
        "",
        *table,
        "",
        "Per role (median over data-parallel ranks and runs) and for the whole job (sum over processes, "
        "median over runs):",
        "",
        *summary_lines,
    ])
    if alive:
        text += f"\n\n{alive} worker process(es) had not exited when CPU was read: their CPU is missing."
    print()
    print(text)
    if not args.no_write:
        from _benchdoc import DOC, publish

        publish("read-once", text, args.out or DOC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
