"""Hugging Face accelerate, for real, under ``torchrun --nproc_per_node 2`` (gloo, CPU):

* a ``StreamingLoader`` registered by ``streamforge.integrations.accelerate.prepare`` is saved
  by ``save_state`` after step 5 and restored by ``load_state`` in new processes: steps 5-11
  train the uninterrupted run's batches, with its losses, bit for bit, on both ranks;
* ``accelerator.prepare(DataLoader(PackedTokenDataset))``, which would shard the dataset a
  second time (dispatching rank 0's share, or dropping all but one batch in N), is a
  ``ConfigError`` saying what to do instead, in the main process and in a worker process.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers.pipeline import random_docs, write_stream
from helpers.torchrun import torchrun

pytest.importorskip("accelerate", reason="the accelerate tests need the accelerate extra (pip install -e '.[accelerate]')")

WORKER = Path(__file__).parent / "helpers" / "workers" / "accelerate_worker.py"
SAVE_AT, STEPS = 5, 12


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate")
    rng = np.random.default_rng(5)
    urls = []
    for name, n, median in (("web", 40, 30), ("code", 15, 60)):
        urls.append(str(root / name))
        write_stream(urls[-1], random_docs(rng, n, median))
    return root, urls


def _torchrun(out: Path, phase: str, urls: list[str]) -> None:
    torchrun(WORKER, out, phase, *urls)


def _steps(path: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


def test_save_state_and_load_state_resume_exactly(job):
    out, urls = job
    _torchrun(out, "run", urls)
    _torchrun(out, "resume", urls)
    for rank in range(2):
        want, got = _steps(out / f"run-rank{rank}.jsonl"), _steps(out / f"resume-rank{rank}.jsonl")
        assert sorted(got) == list(range(SAVE_AT, STEPS))
        assert all(got[s] == want[s] for s in got), f"rank {rank}: another batch or loss after the resume"
        report = json.loads((out / f"resume-report-rank{rank}.json").read_text())
        assert report == {"rank": rank, "world_size": 2, "step": STEPS, "resume": "exact"}
    assert _steps(out / "run-rank0.jsonl")[0]["ids"] != _steps(out / "run-rank1.jsonl")[0]["ids"]


def test_a_prepared_dataloader_over_the_dataset_is_refused(job):
    out, urls = job
    _torchrun(out, "refuse", urls)
    for rank in range(2):
        report = json.loads((out / f"refuse-report-rank{rank}.json").read_text())
        assert "prepare() wrapped (DataLoaderDispatcher)" in report["dispatch"]
        assert "only rank 0's share would be read" in report["dispatch"]
        assert "every process would drop all but one batch in N" in report["shard"]
        for case in ("dispatch", "shard"):
            assert "streamforge.integrations.accelerate.prepare(accelerator, loader)" in report[case]
