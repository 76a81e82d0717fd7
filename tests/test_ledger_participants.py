"""The ledger of participants that come and go on their own (torchft's replica groups): a
participant's restart voids its own later steps only, a step never committed is void, a step
put back after it reached storage is void, and ``check`` counts the live participants of
every step against the membership history."""

from __future__ import annotations

import numpy as np

from streamforge.ledger.report import check
from streamforge.ledger.store import LedgerWriter, read_ledger
from streamforge.pipeline.batch import RowBatch

META = {"streams": [{"name": "s", "manifest": "x"}], "seq_len": 8, "batch_size": 1}
HISTORY = [[0, 2], [5, 1], [10, 2]]


def _rows(record: int) -> RowBatch:
    one = np.ones(1, np.int64)
    return RowBatch(np.zeros((1, 9), np.uint16), np.zeros(1, bool), 0 * one, 8 * one, np.zeros(1, np.int16),
                    np.zeros(1, np.int32), np.array([record], np.int64), 0 * one, np.zeros(1, bool))


def _writer(url: str, rank: int) -> LedgerWriter:
    w = LedgerWriter(url, rank=rank, world_size=2, meta=META)
    w.participant = w.commits = True
    w.history = HISTORY
    return w


def _job(url: str, drop: tuple[int, int] | None = None) -> None:
    """Participants 0 and 1 train steps 0..4; participant 1 dies in step 5 (handed out, never
    committed); participant 0 had step 5 on storage, puts it back and does it again alone with
    participant 1's share (record 1000 both times), up to step 9; participant 1 comes back at
    step 10 (a new process, healed), and both train steps 10..12. ``drop``: a (rank, step) not
    recorded."""
    w0, w1 = _writer(url, 0), _writer(url, 1)
    for step in range(5):
        for rank, w in ((0, w0), (1, w1)):
            if (rank, step) != drop:
                w.add(step, 0, _rows(10 * step + rank))
            w.commit(step)
    w1.add(5, 0, _rows(1000))
    w1.flush()  # on storage, then the process is killed: no commit of step 5
    del w1
    w0.add(5, 0, _rows(50))
    w0.flush()
    w0.start_generation(5, "membership", scope="participant")  # put back: its own step 5 only
    # participant 1's new process takes its number before participant 0 wrote one: the same
    # number (no process group joins them), two restarts
    w1 = _writer(url, 1)
    w1.start_generation(10, "exact")  # healed at step 10: voids participant 1's steps >= 10 only
    assert w1.generation == w0.generation
    for step in range(5, 10):
        w0.add(step, 0, _rows(1000 if step == 5 else 10 * step))
        w0.commit(step)
    for step in range(10, 13):
        for rank, w in ((0, w0), (1, w1)):
            if (rank, step) != drop:
                w.add(step, 0, _rows(10 * step + rank))
            w.commit(step)
    w0.close()
    w1.close()


def test_participants_restart_and_put_back_on_their_own(tmp_path):
    url = str(tmp_path / "ledger")
    _job(url)
    ledger = read_ledger(url)
    kept = sorted(zip(ledger.steps["rank"].tolist(), ledger.steps["step"].tolist()))
    assert kept == [(0, s) for s in range(13)] + [(1, s) for s in (*range(5), 10, 11, 12)]
    assert list(zip(ledger.rolled_back["rank"].tolist(), ledger.rolled_back["step"].tolist())) == [(0, 5)]
    assert list(zip(ledger.uncommitted["rank"].tolist(), ledger.uncommitted["step"].tolist())) == [(1, 5)]
    report = check(ledger)
    assert report["ok"], report["problems"]
    assert not report["duplicates"] and report["membership"] == HISTORY
    assert report["ledger"]["uncommitted_rank_steps"] == 1
    assert [(r["resumed_at_step"], r["ranks"], r["scope"]) for r in report["ledger"]["restarts"]] == [
        (0, [0, 1], "participant"), (5, [0], "participant"), (10, [1], "participant")]


def test_a_step_a_live_participant_did_not_record_is_reported(tmp_path):
    url = str(tmp_path / "ledger")
    _job(url, drop=(1, 11))
    report = check(read_ledger(url))
    assert not report["ok"]
    assert any("membership history has live (first: step 11, 1 recorded, 2 live)" in p for p in report["problems"])


def test_a_step_its_quorum_committed_counts_for_a_participant_killed_before_its_commit(tmp_path):
    """Under torchft a group killed after its gradients were reduced, before its own commit, was
    trained at that step by the group that committed it: its step (on storage since it was handed
    out) counts, and nothing is missing; where the step was redone on a smaller membership it
    stays void (``test_participants_restart_and_put_back_on_their_own``)."""
    url = str(tmp_path / "ledger")
    history = [[0, 2], [6, 1]]
    w0, w1 = _writer(url, 0), _writer(url, 1)
    w0.history = w1.history = history
    for step in range(6):
        for rank, w in ((0, w0), (1, w1)):
            w.add(step, 0, _rows(10 * step + rank))
            if (rank, step) != (1, 5):
                w.commit(step)
    w1.flush()  # step 5 handed out and on storage; killed before its commit
    del w1
    for step in range(6, 9):
        w0.add(step, 0, _rows(10 * step))
        w0.commit(step)
    w0.close()
    ledger = read_ledger(url)
    kept = sorted(zip(ledger.steps["rank"].tolist(), ledger.steps["step"].tolist()))
    assert kept == [(0, s) for s in range(9)] + [(1, s) for s in range(6)]
    assert len(ledger.uncommitted["step"]) == 0
    assert sorted(ledger.pieces["record"][ledger.pieces["rank"] == 1].tolist()) == [1, 11, 21, 31, 41, 51]
    report = check(ledger)
    assert report["ok"], report["problems"]
