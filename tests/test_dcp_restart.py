"""A real job killed and restarted: torchrun with 2 gloo ranks trains a tiny model, saves
model, optimizer and loader through torch.distributed.checkpoint mid-pass, carries on, and
is killed with SIGKILL. A new torchrun of 2 ranks loads the checkpoint into fresh objects
and continues: its losses equal the uninterrupted run's, step for step, bit for bit. A new
torchrun of 1 or 3 ranks resumes elastically: over the whole pass (the crashed run's steps
before its checkpoint, then the restart's), every token is delivered once, nothing is
lost beyond the plans' drop bounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.pipeline import random_docs, write_stream
from helpers.s3_server import free_port
from streamforge import Manifest, PackedTokenDataset, Stream, StreamingLoader, read_ledger
from streamforge.ledger.report import check

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "helpers" / "workers" / "dcp_worker.py"
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


def _torchrun(out: Path, ckpt: Path, mode: str, kill_at: int, urls: list[str], nproc: int = 2,
              steps: int = STEPS) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(WORKER), str(out), str(ckpt), mode, str(steps), str(SAVE_AT),
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
    # each rank kills itself after step KILL_AT - 1; the first to die takes the job down, so
    # the other may be stopped by torchrun before it logs that step (past the checkpoint still)
    last = [max(_losses(crash_dir / f"losses-run-rank{rank}.jsonl")) for rank in range(2)]
    assert max(last) == KILL_AT - 1 and min(last) >= SAVE_AT, last
    proc = _torchrun(crash_dir, crash_dir / "ckpt", "resume", 0, urls)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        want = _losses(ref_dir / f"losses-run-rank{rank}.jsonl")
        got = _losses(crash_dir / f"losses-resume-rank{rank}.jsonl")
        assert sorted(got) == list(range(SAVE_AT, STEPS))  # on from the checkpoint's step
        assert [got[s] for s in sorted(got)] == [want[s] for s in sorted(got)]  # bit for bit
        report = json.loads((crash_dir / f"report-resume-rank{rank}.json").read_text())
        assert report["resume"] == "exact" and report["step"] == STEPS


def _pieces(path: Path, before: int | None = None) -> list[list[int]]:
    out = []
    for row in map(json.loads, path.read_text().splitlines()):
        if before is None or row["step"] < before:
            out += row["pieces"]
    return out


@pytest.mark.parametrize("nproc", [1, 3])
def test_sigkilled_job_resumes_elastically_on_another_world_size(urls, tmp_path, nproc):
    crashed = _torchrun(tmp_path, tmp_path / "ckpt", "run", KILL_AT, urls, steps=0)
    assert crashed.returncode != 0
    pieces = [p for r in range(2) for p in _pieces(tmp_path / f"losses-run-rank{r}.jsonl", before=SAVE_AT)]
    proc = _torchrun(tmp_path, tmp_path / "ckpt", "resume", 0, urls, nproc=nproc, steps=0)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads((tmp_path / f"report-resume-rank{r}.json").read_text()) for r in range(nproc)]
    assert {r["resume"] for r in reports} == {"elastic"} and {r["world"] for r in reports} == {nproc}
    assert len({r["step"] for r in reports}) == 1  # every rank finished the same steps
    for r in range(nproc):
        pieces += _pieces(tmp_path / f"losses-resume-rank{r}.jsonl")
    spans: dict[tuple, list] = {}
    for stream, shard, record, start, length in pieces:
        spans.setdefault((stream, shard, record), []).append((start, start + length))
    delivered = 0
    for key, got in spans.items():
        got.sort()
        assert all(b0 <= a1 for (_, b0), (a1, _) in zip(got, got[1:])), f"{key} delivered twice"
        delivered += sum(b - a for a, b in got)
    manifests = [Manifest.load(u) for u in urls]
    total = sum(m.num_tokens + int(m.columns["num_docs"].sum()) for m in manifests)  # EOS appended
    streams = [Stream(u, weight=w, name=f"s{i}") for i, (u, w) in enumerate(zip(urls, [0.7, 0.3]))]
    saved_job = StreamingLoader(PackedTokenDataset(streams, seq_len=64, shuffle_buffer=32, rank=0, world_size=2),
                                batch_size=2, num_workers=1)  # the crashed job's plan, as each of its ranks had it
    bound = saved_job.plan().drop_bound() + reports[0]["drop_bound"]
    assert 0 <= total - delivered <= bound
    # the ledger over the whole run says the same: the killed run's steps past its checkpoint
    # rolled back, every token once, what was not delivered within the drop bound
    from streamforge.cli import main as cli

    assert cli(["ledger", "check", str(tmp_path / "ledger")]) == 0
    report = check(read_ledger(str(tmp_path / "ledger")))
    assert report["ok"] and [r["mode"] for r in report["ledger"]["restarts"]] == ["fresh", "elastic"]
    # steps past the checkpoint that reached the ledger before the kill are rolled back
    assert 0 <= report["ledger"]["rolled_back_rank_steps"] <= 2 * (KILL_AT - SAVE_AT)
    (summary,) = report["passes"]
    assert summary["complete"] and summary["delivered_tokens"] == delivered
    assert summary["not_delivered_tokens"] <= summary["drop_bound"]
