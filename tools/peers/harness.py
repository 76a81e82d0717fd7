"""Running a case in a fresh process of its own (its own session, killed with its workers on a
timeout), sampling the summed RSS of its process tree every 50 ms until it reports, and the
CPU-seconds of a process tree."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .settings import CREDS, ENTRY, ROOT


def tree_cpu() -> float:
    """CPU-seconds (user + sys) of this process, its live descendants and all reaped ones."""
    try:
        import psutil
    except ImportError:  # reaped children only: workers still alive are missed
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    me = psutil.Process()
    total = 0.0
    for proc in [me] + me.children(recursive=True):
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


class ChildFailed(RuntimeError):
    pass


MARKER = "@@RESULT "


def run_child(spec: dict, timeout: float, env: dict | None = None) -> dict:
    """Run ``spec`` in a fresh process (its own session); sample the RSS of its process tree
    every 50 ms until it prints its result; return its result with ``rss`` (peak of the summed
    tree, bytes)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        spec_path = f.name
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, ENTRY, "--child", spec_path], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)
    try:
        peak = watch(proc, log, timeout)
    finally:
        os.unlink(spec_path)
    log.seek(0)
    text = log.read()
    log.close()
    marker = text.rfind(MARKER)
    if proc.returncode != 0 or marker < 0:
        raise ChildFailed(f"exit {proc.returncode}: {error_line(text)}")
    out = json.loads(text[marker + len(MARKER):].splitlines()[0])
    out["rss"] = peak
    return out


def watch(proc: subprocess.Popen, log, timeout: float, every: float = 0.05) -> int | None:
    """Wait for ``proc`` (writing to the file ``log``); return the peak summed RSS of its
    process tree (bytes; None without psutil), sampled every ``every`` seconds up to the
    moment its result line shows in ``log``. What the process does after it has reported
    (its interpreter's teardown) is not the case's: torch 2.14 (CUDA build) touches about
    110 MiB of its libraries' pages in the last 20 ms of every process, which a 50 ms sampler
    caught or missed by chance. On a timeout the process and its session are killed."""
    try:
        import psutil
    except ImportError:
        psutil = None
    peak, deadline = 0, time.monotonic() + timeout
    fd, seen, reported = log.fileno(), 0, False
    try:
        root = psutil.Process(proc.pid) if psutil else None
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise ChildFailed(f"timed out after {timeout:.0f} s")
            if not reported:
                size = os.fstat(fd).st_size
                if size > seen:  # the new bytes, and the marker's length before them
                    start = max(0, seen - len(MARKER))
                    reported = MARKER.encode() in os.pread(fd, size - start, start)
                    seen = size
            if root is not None and not reported:
                total = 0
                try:
                    for p in [root] + root.children(recursive=True):
                        try:
                            total += p.memory_info().rss
                        except psutil.Error:
                            pass
                except psutil.Error:
                    pass
                peak = max(peak, total)
            time.sleep(every)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and its workers
            proc.wait()
    return peak if psutil else None


def error_line(text: str) -> str:
    """The exception line of a child's traceback (else its last line), shortened."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    found = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", line)]
    return (found[-1] if found else (lines[-1] if lines else "no output"))[:300]


CHILD_ENV = {
    "S3_ENDPOINT_URL": "",  # Mosaic's S3 endpoint: set per run
    "LITDATA_DISABLE_VERSION_CHECK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def child_env(spec: dict) -> dict:
    env = dict(CHILD_ENV)
    if spec.get("s3"):
        env.update(CREDS)
        env["S3_ENDPOINT_URL"] = spec["s3"]["endpoint"]
        env["AWS_ENDPOINT_URL"] = spec["s3"]["endpoint"]
    return env


def run_case(spec: dict, timeout: float) -> dict:
    os.makedirs(os.path.dirname(spec["cache"]), exist_ok=True)
    shutil.rmtree(spec["cache"], ignore_errors=True)
    try:
        return run_child(spec, timeout, child_env(spec))
    finally:
        shutil.rmtree(spec["cache"], ignore_errors=True)
