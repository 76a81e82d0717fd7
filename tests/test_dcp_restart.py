"""A real job killed and restarted: torchrun with 2 gloo ranks trains a tiny model, saves
model, optimizer and loader through torch.distributed.checkpoint mid-pass, carries on, and
is killed with SIGKILL; a new torchrun of 2 ranks loads the checkpoint into fresh objects
and continues. Its losses equal the uninterrupted run's, step for step, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline_helpers import random_docs, write_stream
from s3_server import free_port

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "dcp_worker.py"
STEPS, SAVE_AT, KILL_AT = 12, 5, 8


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    rng = np.random.default_rng(3)
    out = []
    for name, n, median in (("web", 200, 60), ("code", 60, 200)):
        url = str(root / name)
        write_stream(url, random_docs(rng, n, median))
        out.append(url)
    return out


def _torchrun(out: Path, ckpt: Path, mode: str, kill_at: int, urls: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(WORKER), str(out), str(ckpt), mode, str(STEPS), str(SAVE_AT),
           str(kill_at), *urls]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def test_sigkilled_job_resumes_from_dcp_on_the_same_loss_curve(urls, tmp_path):
    ref_dir, crash_dir = tmp_path / "ref", tmp_path / "crash"
    ref_dir.mkdir()
    crash_dir.mkdir()
    proc = _torchrun(ref_dir, ref_dir / "ckpt", "run", 0, urls)
    assert proc.returncode == 0, proc.stderr[-4000:]
    crashed = _torchrun(crash_dir, crash_dir / "ckpt", "run", KILL_AT, urls)
    assert crashed.returncode != 0  # the job died, past its checkpoint
    for rank in range(2):
        assert max(_losses(crash_dir / f"losses-run-rank{rank}.jsonl")) == KILL_AT - 1
    proc = _torchrun(crash_dir, crash_dir / "ckpt", "resume", 0, urls)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        want = _losses(ref_dir / f"losses-run-rank{rank}.jsonl")
        got = _losses(crash_dir / f"losses-resume-rank{rank}.jsonl")
        assert sorted(got) == list(range(SAVE_AT, STEPS))  # on from the checkpoint's step
        assert [got[s] for s in sorted(got)] == [want[s] for s in sorted(got)]  # bit for bit
        report = json.loads((crash_dir / f"report-resume-rank{rank}.json").read_text())
        assert report["resume"] == "exact" and report["step"] == STEPS
