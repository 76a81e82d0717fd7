"""Worker processes: the shared-memory ring that carries their batches to the main process,
and how they are started."""

import gc

import numpy as np
import pytest
import torch

from streamforge.batch import RowBatch
from streamforge.workers import _Ring, _Rings, _start_workers


def _rows(seed: int, pieces: int = 3, rows: int = 2, width: int = 9) -> RowBatch:
    rng = np.random.default_rng(seed)
    return RowBatch(
        tokens=rng.integers(0, 60000, (rows, width)).astype(np.uint16),
        lookahead=rng.integers(0, 2, rows).astype(bool),
        start=np.sort(rng.integers(0, rows * (width - 1), pieces)).astype(np.int64),
        length=rng.integers(1, 5, pieces).astype(np.int64),
        stream=rng.integers(0, 3, pieces).astype(np.int16),
        shard=rng.integers(0, 9, pieces).astype(np.int32),
        record=rng.integers(0, 99, pieces).astype(np.int64),
        token_start=rng.integers(0, 99, pieces).astype(np.int64),
        continues=rng.integers(0, 2, pieces).astype(bool),
    )


def _message(seed: int, count: int, **kw) -> list[tuple]:
    return [("batch", 0, seed * 10 + i, _rows(seed * 10 + i, **kw), {"step": i}, None, None) for i in range(count)]


def _same(a: RowBatch, b: RowBatch) -> None:
    for name in RowBatch.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name


def test_messages_come_out_equal_through_every_slot_twice():
    ring, rings = _Ring(0, slots=3, slot_bytes=4096), _Rings()
    kinds = []
    for seed in range(8):  # the first travels whole, the next seven wrap around the ring
        sent = _message(seed, 1 + seed % 3)
        shipped = ring.ship([item[:3] + (_copy(item[3]),) + item[4:] for item in sent])
        kinds.append(shipped[0])
        got = rings.receive(shipped)
        assert [g[:3] + g[4:] for g in got] == [s[:3] + s[4:] for s in sent]
        for g, s in zip(got, sent):
            _same(g[3], s[3])
    assert kinds == ["whole"] + ["ring"] * 7
    # what came out is a private copy: writing the slot again does not change it
    kept = got[0][3].tokens.copy()
    ring.ship(_message(99, 1))
    ring.memory[_Ring.HEADER:] = 0
    assert np.array_equal(got[0][3].tokens, kept)


def test_a_message_larger_than_a_slot_travels_whole():
    ring, rings = _Ring(0, slots=2, slot_bytes=256), _Rings()
    rings.receive(ring.ship(_message(0, 1)))
    big = _message(1, 2, pieces=50)
    shipped = ring.ship(big)
    assert shipped[0] == "whole"
    _same(rings.receive(shipped)[1][3], big[1][3])


def test_a_slot_never_acknowledged_makes_the_message_travel_whole(monkeypatch):
    monkeypatch.setattr(_Ring, "WAIT", 0.05)
    ring = _Ring(0, slots=2, slot_bytes=4096)
    ring.ship(_message(0, 1))  # whole
    assert [ring.ship(_message(s, 1))[0] for s in (1, 2, 3)] == ["ring", "ring", "whole"]


def test_each_batch_of_a_message_gets_back_its_own_pieces():
    """The fields of a message's batches lie end to end in the slot; each batch is cut back
    out by its own lengths (here 0 to 6 pieces, and rows of two widths in two messages)."""
    ring, rings = _Ring(0, slots=2, slot_bytes=1 << 16), _Rings()
    rings.receive(ring.ship(_message(0, 1)))
    for width in (9, 17):
        sent = [("batch", 1, i, _rows(i, pieces=i, width=width), {"step": i}, None, None) for i in range(7)]
        expected = [_copy(item[3]) for item in sent]
        shipped = ring.ship(sent)
        assert shipped[0] == "ring"
        for g, e in zip(rings.receive(shipped), expected):
            _same(g[3], e)


@pytest.mark.parametrize("differ", ["width", "dtype"])
def test_batches_that_cannot_lie_end_to_end_travel_whole(differ):
    ring, rings = _Ring(0, slots=2, slot_bytes=1 << 16), _Rings()
    rings.receive(ring.ship(_message(0, 1)))
    other = _rows(1, width=17 if differ == "width" else 9)
    if differ == "dtype":
        other.tokens = other.tokens.astype(np.uint32)
    sent = [("batch", 1, 0, _rows(0, width=9), {}, None, None), ("batch", 1, 1, other, {}, None, None)]
    shipped = ring.ship(sent)
    assert shipped[0] == "whole"
    _same(rings.receive(shipped)[1][3], other)
    assert ring.ship(_message(2, 2))[0] == "ring"  # the slot it did not take is still free


def _copy(rows: RowBatch) -> RowBatch:
    return RowBatch(**{name: getattr(rows, name).copy() for name in RowBatch.__dataclass_fields__})


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_token_dtypes_survive(dtype):
    ring, rings = _Ring(0, slots=2, slot_bytes=8192), _Rings()
    rings.receive(ring.ship(_message(0, 1)))
    sent = _message(1, 2)
    for item in sent:
        item[3].tokens = item[3].tokens.astype(dtype)
    expected = [_copy(item[3]) for item in sent]
    got = rings.receive(ring.ship(sent))
    for g, e in zip(got, expected):
        _same(g[3], e)


class _FreezeCount(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield gc.get_freeze_count()


@pytest.mark.parametrize("user_froze", [False, True])
def test_workers_start_with_the_trainers_objects_frozen_and_the_trainer_gets_them_back(user_froze):
    """A forked worker must not walk (and copy) the trainer's objects in its first full
    collection; the trainer's own collector is left as it was."""
    gc.unfreeze()
    if user_froze:
        gc.freeze()
    try:
        before = gc.get_freeze_count()
        loader = torch.utils.data.DataLoader(_FreezeCount(), batch_size=None, num_workers=1,
                                             multiprocessing_context="fork")
        iterator = _start_workers(loader)
        # the trainer's collector is as it was (frozen objects that died meanwhile are gone)
        assert gc.get_freeze_count() == 0 if not user_froze else gc.get_freeze_count() > before // 2
        in_worker = next(iterator)
        assert in_worker > 0
        if not user_froze:
            assert in_worker > 1000  # the trainer's objects, not a handful
        iterator._shutdown_workers()
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_started_without_fork_hand_over_the_same_batches(tmp_path, context):
    """The ring reaches the main process by torch's fd hand-over, which needs no fork: workers
    that import everything afresh give the batches of forked ones."""
    from pipeline_helpers import assert_batches_equal, dataset, loader, make_corpus, take

    corpus = make_corpus(tmp_path, np.random.default_rng(3))
    ds = dataset(corpus, weights=[0.5, 0.3, 0.2])
    reference = take(loader(ds, num_workers=2, batch_size=4, multiprocessing_context="fork"))
    got = take(loader(ds, num_workers=2, batch_size=4, multiprocessing_context=context))
    assert len(reference) > 20
    assert_batches_equal(got, reference)
