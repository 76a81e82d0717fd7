"""The real torchft: a lighthouse and two replica groups, each its own torchrun job (one
process, gloo on CPU, loopback). Group 1 is killed mid-pass and restarted; it heals and
rejoins; later group 0 is killed and restarted the same way. Every token of the pass is
trained exactly once across the groups: the ledger the groups keep in one folder (each its own
participant, a restart voiding its own steps only, steps never committed void) checks with no
duplicate and nothing missing beyond what the plan's segments drop; and the committed steps'
document pieces, logged by each group, are the plan's for their step and position."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers.pipeline import make_corpus
from helpers.s3_server import free_port
from helpers.torchrun import ROOT
from streamforge.ledger.report import check
from streamforge.ledger.store import read_ledger

torchft = pytest.importorskip("torchft", reason="torchft is not installed (the 'torchft' extra; wheels exist for "
                                                "Linux x86_64 only)")

WORKER = Path(__file__).parent / "helpers" / "workers" / "torchft_group.py"
SPEC = (("code", 30, 120), ("web", 90, 40))


def _launch(corpus, group, log, lighthouse, out, die=None):
    ledger = log.parent / "ledger"
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path,
           "TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1"}
    env.pop("SF_TEST_DIE", None)
    if die is not None:  # where this launch kills itself (tests/helpers/workers/torchft_group.py)
        env["SF_TEST_DIE"] = die
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(WORKER), str(corpus), str(group), "2", str(log), lighthouse,
           str(ledger)]
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _records(log):
    out = []
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def _wait(what, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if what():
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


def _stop(proc, log):
    """Stop a launched job still running: its trainer and its torchrun, each by its own pid."""
    if proc.poll() is None:
        pid = Path(f"{log}.pid")
        if pid.exists():
            try:
                os.kill(int(pid.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
    proc.wait(timeout=30)


def test_groups_killed_and_restarted_train_every_token_once(tmp_path):
    corpus = tmp_path / "corpus"
    make_corpus(corpus, np.random.default_rng(7), spec=SPEC)
    logs = [tmp_path / "group0.jsonl", tmp_path / "group1.jsonl"]
    out = open(tmp_path / "jobs.log", "w")
    port = free_port()
    address = f"http://127.0.0.1:{port}"
    lighthouse = subprocess.Popen(
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
         "--join_timeout_ms", "500", "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "1000"],
        stdout=out, stderr=subprocess.STDOUT)
    jobs = []
    try:
        # group 1 kills itself in the middle of a step (its gradients reduced, nothing committed)
        # once it has trained 4 steps beside group 0; group 0 kills itself between two steps once
        # it has trained alone and then 4 steps beside group 1 again (SIGKILL, each by its own
        # pid: at a moment the trainer picks, not one racing its log line)
        dies = {0: "between:1", 1: "mid:0"}
        jobs = [_launch(corpus, g, logs[g], address, out, die=dies[g]) for g in (0, 1)]

        def kill_and_restart(dead):
            """Both groups train together, then ``dead`` dies mid-pass; the other goes on alone
            for a while, then ``dead`` comes back (a new torchrun job) and heals."""
            jobs[dead].wait(timeout=120)  # its trainer kills itself; its torchrun sees it die and exits
            killed_at = max(r["step"] for r in _records(logs[dead]) if "step" in r)
            _wait(lambda: sum(r.get("n") == 1 and r["step"] > killed_at for r in _records(logs[1 - dead])
                              if "step" in r) >= 3, timeout=60)
            jobs[dead] = _launch(corpus, dead, logs[dead], address, out)
            return killed_at

        kills = [(1, kill_and_restart(1))]
        kills.append((0, kill_and_restart(0)))  # then the other group, later
        for job in jobs:
            job.wait(timeout=120)
        assert [job.returncode for job in jobs] == [0, 0], (tmp_path / "jobs.log").read_text()[-4000:]
    finally:
        for job, log in zip(jobs, logs):
            _stop(job, log)
        lighthouse.kill()  # by its pid
        lighthouse.wait(timeout=30)
        out.close()

    # the ledger: every token of the pass trained once across the groups, nothing missing but the drop
    ledger = read_ledger(tmp_path / "ledger")
    report = check(ledger)
    assert report["ok"], report["problems"]
    assert not report["duplicates"]
    [entry] = report["passes"]
    assert entry["complete"] and entry["skipped_tokens"] == 0
    assert entry["not_delivered_tokens"] == entry["dropped_tokens"] <= entry["drop_bound"], entry
    for group, killed_at in kills:  # its heal voided its own steps only: the survivor's stand
        assert any(r["ranks"] == [group] and r["scope"] == "participant" and r["resumed_at_step"] > killed_at
                   for r in report["ledger"]["restarts"]), report["ledger"]["restarts"]

    records = _records(logs[0]) + _records(logs[1])
    # group 1 died in the middle of the step after its last logged one, its gradients reduced
    # with group 0's, which committed the step: group 1's batch was trained there, and the ledger
    # holds it (written before the batch was handed out), though its log does not
    mid = kills[0][1] + 1
    assert any(r.get("step") == mid and r.get("n") == 2 for r in _records(logs[0]))
    p = ledger.pieces
    mine = (p["rank"] == 1) & (p["step"] == mid)
    assert mine.any(), "group 1's last step, trained through group 0's commit, is not in the ledger"
    cols = np.stack([p[k][mine] for k in ("stream", "shard", "record", "token_start", "length")], axis=1)
    died = {"step": mid, "group": 1, "rank": 1, "n": 2, "pieces": cols.tolist()}
    steps = [r for r in records if "step" in r]
    ends = [r for r in records if "end" in r]
    assert len(ends) == 2 and ends[0]["end"] == ends[1]["end"]  # one clock: the pass ends at one step for both
    for group, killed_at in kills:  # each came back and trained again, after steps the other trained alone
        rejoined = [r["step"] for r in steps if r["group"] == group and r["step"] > killed_at and r["n"] == 2]
        assert rejoined, f"group {group} never trained again after its restart"
        assert any(killed_at < r["step"] < min(rejoined) and r["n"] == 1 for r in steps)
    steps.append(died)
    # each committed (step, group) once; every token of the pass at most once
    assert len({(r["step"], r["group"]) for r in steps}) == len(steps)
    seen: dict[tuple, list] = {}
    for r in steps:
        for stream, shard, record, start, length in r["pieces"]:
            seen.setdefault((stream, shard, record), []).append((start, start + length))
    for key, spans in seen.items():
        spans.sort()
        for (a0, b0), (a1, _) in zip(spans, spans[1:]):
            assert b0 <= a1, f"{key}: tokens {a1}..{b0} trained twice"
    # every committed step holds what the plan says (the same history stepped in one process, the
    # participants by their position among the live groups),
    # and nothing is missing beyond what the plan's last segment drops
    sys.path.insert(0, str(WORKER.parent))
    from test_membership import drive
    from torchft_group import build

    history = [(s, set(range(n))) for s, n in ends[0]["state"]["history"]]
    assert report["membership"] == ends[0]["state"]["history"]
    counts = [n for _, n in ends[0]["state"]["history"]]
    assert any(counts[i:i + 5] == [2, 1, 2, 1, 2] for i in range(len(counts))), counts
    want, end, bound, _ = drive(lambda g: build(corpus, g, 2), history, 2)
    assert end == ends[0]["end"]
    got = {(r["step"], r["rank"]): sorted(map(tuple, r["pieces"])) for r in steps}  # by position among the live
    assert got == {key: sorted(map(tuple, p.tolist())) for key, p in want.items()}
    docs = make_corpus(tmp_path / "again", np.random.default_rng(7), spec=SPEC)
    total = sum(len(x) + 1 for _, d in docs.values() for x in d if len(x))
    trained = sum(b - a for spans in seen.values() for a, b in spans)
    assert 0 <= total - trained <= bound
    assert total - trained == entry["not_delivered_tokens"] and trained == entry["delivered_tokens"]
