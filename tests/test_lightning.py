"""PyTorch Lightning, for real: ``Trainer(accelerator="cpu", devices=2)`` under ``ddp`` and
``ddp_spawn`` trains a tiny model from streamforge for 12 steps, with a checkpoint after step
5; a second ``fit(ckpt_path=...)`` resumes from it. Over steps 5-11 the resumed run's batches
and losses equal the uninterrupted run's, bit for bit, on both ranks: finite (the loader's
length stops Lightning's look-ahead) and infinite (``LightningLoader``), with 0 and 1 worker.
The corpus is small enough that the 12 steps cross pass ends (a checkpoint then a pass end).

The dataset is built in the DataModule's ``__init__``, before the process group exists: each
rank still reads its own shards (the ranks' batches differ, and the topology is the group's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.pipeline import random_docs, write_stream

pytest.importorskip("lightning", reason="the Lightning tests need the lightning extra (pip install -e '.[lightning]')")

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "helpers" / "workers" / "lightning_worker.py"
SAVE_AT, STEPS = 5, 12


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    rng = np.random.default_rng(5)
    out = []
    for name, n, median in (("web", 10, 30), ("code", 5, 50)):
        out.append(str(root / name))
        write_stream(out[-1], random_docs(rng, n, median))
    return out


def _fit(out: Path, strategy: str, mode: str, workers: int, phase: str, urls: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, str(WORKER), str(out), strategy, mode, str(workers), phase, *urls]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=out)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _steps(path: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("strategy,mode,workers", [
    ("ddp", "finite", 0), ("ddp", "infinite", 1), ("ddp_spawn", "finite", 1), ("ddp_spawn", "infinite", 0),
])
def test_a_lightning_resume_trains_the_batches_of_the_uninterrupted_run(urls, tmp_path, strategy, mode, workers):
    _fit(tmp_path, strategy, mode, workers, "run", urls)
    _fit(tmp_path, strategy, mode, workers, "resume", urls)
    for rank in range(2):
        want, got = _steps(tmp_path / f"run-rank{rank}.jsonl"), _steps(tmp_path / f"resume-rank{rank}.jsonl")
        assert sorted(want) == list(range(STEPS)) and sorted(got) == list(range(SAVE_AT, STEPS))
        for step in got:
            assert got[step]["ids"] == want[step]["ids"], f"rank {rank} step {step}: another batch"
            assert got[step]["loss"] == want[step]["loss"], f"rank {rank} step {step}"
        report = json.loads((tmp_path / f"resume-report-rank{rank}.json").read_text())
        assert report["resume"] == "exact" and report["step"] == STEPS
        assert (report["rank"], report["world_size"], report["source"]) == (rank, 2, "torch.distributed")
    ranks = [_steps(tmp_path / f"run-rank{rank}.jsonl") for rank in range(2)]
    assert all(ranks[0][s]["ids"] != ranks[1][s]["ids"] for s in range(STEPS))  # each rank its own shards
