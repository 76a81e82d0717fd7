"""Worker processes: the shared-memory ring that carries their batches to the main process,
and how they are started."""

import dataclasses
import gc
import threading

import numpy as np
import pytest
import torch

from streamforge.pipeline.batch import RowBatch
from streamforge.loader.workers import WorkerBatch, _Ring, _Rings, _shared_bytes, _start_workers


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


def _message(seed: int, count: int, **kw) -> list[WorkerBatch]:
    return [WorkerBatch(0, seed * 10 + i, _rows(seed * 10 + i, **kw), {"step": i}) for i in range(count)]


def _received(rings: _Rings, shipped) -> list[WorkerBatch]:
    """The message's batches, its slot released at once (their tokens copied first)."""
    items, release = rings.receive(shipped)
    items = [dataclasses.replace(item, rows=_copy(item.rows)) for item in items]
    if release is not None:
        release()
    return items


def _same(a: RowBatch, b: RowBatch) -> None:
    for name in RowBatch.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name


def test_messages_come_out_equal_through_every_slot_twice():
    ring, rings = _Ring(0, slots=3, slot_bytes=4096), _Rings()
    kinds = []
    for seed in range(8):  # the first travels whole, the next seven wrap around the ring
        sent = _message(seed, 1 + seed % 3)
        shipped = ring.ship([dataclasses.replace(item, rows=_copy(item.rows)) for item in sent])
        kinds.append(shipped[0])
        got = _received(rings, shipped)
        assert [dataclasses.replace(g, rows=None) for g in got] == [dataclasses.replace(s, rows=None) for s in sent]
        for g, s in zip(got, sent):
            _same(g.rows, s.rows)
    assert kinds == ["whole"] + ["ring"] * 7


def test_tokens_are_read_in_the_slot_until_it_is_released(monkeypatch):
    """A batch's tokens are a view of the worker's slot, its piece columns a private copy (the
    ledger keeps them); the worker writes the slot again only once the main process released
    it, so tokens read before the release are the worker's."""
    monkeypatch.setattr(_Ring, "WAIT", 0.05)
    ring, rings = _Ring(0, slots=2, slot_bytes=4096), _Rings()
    _received(rings, ring.ship(_message(0, 1)))  # the first message travels whole
    sent = _message(1, 2)
    expected = [_copy(item.rows) for item in sent]
    items, release = rings.receive(ring.ship(sent))
    assert np.shares_memory(items[0].rows.tokens, ring.memory)
    assert not any(np.shares_memory(getattr(items[0].rows, name), ring.memory)
                   for name in RowBatch.__dataclass_fields__ if name != "tokens")
    assert ring.ship(_message(2, 1))[0] == "ring"  # the other slot
    assert ring.ship(_message(3, 1))[0] == "whole"  # none free: the first is not released
    for g, e in zip(items, expected):
        _same(g.rows, e)
    release()
    assert ring.ship(_message(4, 1))[0] == "ring"  # the released slot, written again
    assert not np.array_equal(items[0].rows.tokens, expected[0].tokens)
    for g, e in zip(items, expected):  # the pieces stay as they were
        assert np.array_equal(g.rows.record, e.record) and np.array_equal(g.rows.start, e.start)


def _built_in_slot(ring: _Ring, sent: list[tuple]) -> list[tuple]:
    """``sent`` with each batch's tokens built where ``tokens_out`` says, as a worker builds them."""
    out = []
    for j, item in enumerate(sent):
        place = ring.tokens_out(j, item.rows.tokens.shape, item.rows.tokens.dtype)
        assert place is not None, f"batch {j}: no place in the slot"
        place[...] = item.rows.tokens
        out.append(dataclasses.replace(item, rows=dataclasses.replace(item.rows, tokens=place)))
    return out


def test_tokens_built_in_their_slot_travel_without_another_copy(monkeypatch):
    """A worker builds a message's tokens in the slot it will go through: ``ship`` copies its
    other fields only, and the main process reads the same batches."""
    ring, rings = _Ring(0, slots=2, slot_bytes=4096), _Rings()
    assert ring.tokens_out(0, (2, 9), np.dtype(np.uint16)) is None  # the first message travels whole
    _received(rings, ring.ship(_message(0, 1)))
    for seed in (1, 2, 3):  # through both slots, and the first again once released
        sent = _message(seed, 3)
        expected = [_copy(item.rows) for item in sent]
        built = _built_in_slot(ring, sent)
        copies = []
        real = np.concatenate

        def spy(arrays, **kw):
            copies.append(arrays[0].dtype)
            return real(arrays, **kw)

        monkeypatch.setattr(np, "concatenate", spy)
        shipped = ring.ship(built)
        monkeypatch.undo()
        assert shipped[0] == "ring"
        assert len(copies) == len(RowBatch.__dataclass_fields__) - 1 and np.dtype(np.uint16) not in copies
        for g, e in zip(_received(rings, shipped), expected):
            _same(g.rows, e)


def test_a_message_built_in_its_slot_that_travels_whole_keeps_its_tokens(monkeypatch):
    """Tokens built in the slot are copied out of it when their message travels whole (here:
    its pieces do not fit), since the queue pickles it after the slot is written again."""
    monkeypatch.setattr(_Ring, "WAIT", 0.05)
    ring, rings = _Ring(0, slots=2, slot_bytes=512), _Rings()
    _received(rings, ring.ship(_message(0, 1)))
    sent = _message(1, 2, pieces=20)
    expected = [_copy(item.rows) for item in sent]
    shipped = ring.ship(_built_in_slot(ring, sent))
    assert shipped[0] == "whole"
    assert not any(np.shares_memory(item.rows.tokens, ring.memory) for item in shipped[1])
    _built_in_slot(ring, _message(2, 2))  # the same slot, written again
    for g, e in zip(_received(rings, shipped), expected):
        _same(g.rows, e)


def test_no_place_in_a_slot_not_released_yet(monkeypatch):
    """A message whose slot the main process still holds builds its tokens on its own (and
    waits for the slot at ``ship``, as ever)."""
    monkeypatch.setattr(_Ring, "WAIT", 0.05)
    ring, rings = _Ring(0, slots=2, slot_bytes=4096), _Rings()
    _received(rings, ring.ship(_message(0, 1)))
    held = [rings.receive(ring.ship(_built_in_slot(ring, _message(seed, 1)))) for seed in (1, 2)]
    assert ring.tokens_out(0, (2, 9), np.dtype(np.uint16)) is None
    held[0][1]()
    assert ring.tokens_out(0, (2, 9), np.dtype(np.uint16)) is not None


@pytest.mark.parametrize("allocated_shared", [True, False])
def test_a_ring_is_zeroed_shared_memory(monkeypatch, allocated_shared):
    """The ring is allocated in shared memory (or, with a torch that cannot, shared after)
    and its header starts at zero: no message acknowledged."""
    if not allocated_shared:
        monkeypatch.setattr(torch.UntypedStorage, "_new_shared", None, raising=False)
    ring = _shared_bytes((1 << 20) + 3)
    assert ring.is_shared() and ring.dtype == torch.uint8 and ring.numel() == (1 << 20) + 3
    assert not ring.any()


def test_a_message_larger_than_a_slot_travels_whole():
    ring, rings = _Ring(0, slots=2, slot_bytes=256), _Rings()
    _received(rings, ring.ship(_message(0, 1)))
    big = _message(1, 2, pieces=50)
    shipped = ring.ship(big)
    assert shipped[0] == "whole"
    _same(_received(rings, shipped)[1].rows, big[1].rows)


def test_a_slot_never_acknowledged_makes_the_message_travel_whole(monkeypatch):
    monkeypatch.setattr(_Ring, "WAIT", 0.05)
    ring = _Ring(0, slots=2, slot_bytes=4096)
    ring.ship(_message(0, 1))  # whole
    assert [ring.ship(_message(s, 1))[0] for s in (1, 2, 3)] == ["ring", "ring", "whole"]


def test_each_batch_of_a_message_gets_back_its_own_pieces():
    """The fields of a message's batches lie end to end in the slot; each batch is cut back
    out by its own lengths (here 0 to 6 pieces, and rows of two widths in two messages)."""
    ring, rings = _Ring(0, slots=2, slot_bytes=1 << 16), _Rings()
    _received(rings, ring.ship(_message(0, 1)))
    for width in (9, 17):
        sent = [WorkerBatch(1, i, _rows(i, pieces=i, width=width), {"step": i}) for i in range(7)]
        expected = [_copy(item.rows) for item in sent]
        shipped = ring.ship(sent)
        assert shipped[0] == "ring"
        for g, e in zip(_received(rings, shipped), expected):
            _same(g.rows, e)


@pytest.mark.parametrize("differ", ["width", "dtype"])
def test_batches_that_cannot_lie_end_to_end_travel_whole(differ):
    ring, rings = _Ring(0, slots=2, slot_bytes=1 << 16), _Rings()
    _received(rings, ring.ship(_message(0, 1)))
    other = _rows(1, width=17 if differ == "width" else 9)
    if differ == "dtype":
        other.tokens = other.tokens.astype(np.uint32)
    sent = [WorkerBatch(1, 0, _rows(0, width=9), {}), WorkerBatch(1, 1, other, {})]
    shipped = ring.ship(sent)
    assert shipped[0] == "whole"
    _same(_received(rings, shipped)[1].rows, other)
    assert ring.ship(_message(2, 2))[0] == "ring"  # the slot it did not take is still free


def _copy(rows: RowBatch) -> RowBatch:
    return RowBatch(**{name: getattr(rows, name).copy() for name in RowBatch.__dataclass_fields__})


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_token_dtypes_survive(dtype):
    ring, rings = _Ring(0, slots=2, slot_bytes=8192), _Rings()
    _received(rings, ring.ship(_message(0, 1)))
    sent = _message(1, 2)
    for item in sent:
        item.rows.tokens = item.rows.tokens.astype(dtype)
    expected = [_copy(item.rows) for item in sent]
    got = _received(rings, ring.ship(sent))
    for g, e in zip(got, expected):
        _same(g.rows, e)


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
    from helpers.pipeline import assert_batches_equal, dataset, loader, make_corpus, take

    corpus = make_corpus(tmp_path, np.random.default_rng(3))
    ds = dataset(corpus, weights=[0.5, 0.3, 0.2])
    reference = take(loader(ds, num_workers=2, batch_size=4, multiprocessing_context="fork"))
    got = take(loader(ds, num_workers=2, batch_size=4, multiprocessing_context=context))
    assert len(reference) > 20
    assert_batches_equal(got, reference)


@pytest.mark.parametrize("depth", [0, 2])
def test_every_slot_is_released_in_a_pass_with_workers(tmp_path, monkeypatch, depth):
    """Each worker's messages after its first go through the ring: a slot the main process
    did not release would make a later message wait and travel whole. The batches are the
    clock's (each logical worker's pipeline by hand), with the device feed's thread
    (``depth``) running ahead of the training thread or not."""
    from helpers.pipeline import assert_batches_equal, dataset, loader, make_corpus, take
    from test_head_start import _by_hand

    import streamforge.loader.workers as workers

    monkeypatch.setattr(_Ring, "WAIT", 0.05)  # forked with it: a missing release shows at once
    kinds = []
    real = _Rings.receive

    def spy(self, message):
        kinds.append(message[0] if isinstance(message, tuple) else "end")
        return real(self, message)

    monkeypatch.setattr(workers._Rings, "receive", spy)
    ds = dataset(make_corpus(tmp_path, np.random.default_rng(5)), seq_len=32)
    got = take(loader(ds, num_workers=2, device_prefetch=depth, multiprocessing_context="fork"))
    assert_batches_equal(got, _by_hand(ds, 2, len(got)))
    assert kinds.count("whole") == 2 and kinds.count("ring") >= 6, kinds


def _exits_on(monkeypatch) -> list:
    """The threads ``_shutdown_workers`` runs on, in order; off the main thread it takes
    0.3 s longer, so that a fork that does not wait for it meets it running."""
    import time

    from torch.utils.data import dataloader

    threads = []
    real = dataloader._MultiProcessingDataLoaderIter._shutdown_workers

    def spy(self):
        if not self._shutdown:
            threads.append(threading.current_thread())
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.3)
        return real(self)

    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "_shutdown_workers", spy)
    return threads


def test_a_pass_ends_without_waiting_for_its_workers_to_exit(tmp_path, monkeypatch):
    """At the end of a pass the worker processes are stopped and joined on a thread of their
    own; the next iteration joins that thread before it forks its workers, and an iteration
    left early stops its workers before the loop goes on."""
    from helpers.pipeline import dataset, loader, make_corpus, take

    import streamforge.loader.workers as workers

    exits = _exits_on(monkeypatch)
    at_fork = []
    real_start = workers._start_workers

    def start(dl):
        at_fork.append([t.name for t in threading.enumerate() if t.name == "streamforge-workers-exit"])
        return real_start(dl)

    monkeypatch.setattr(workers, "_start_workers", start)
    ds = dataset(make_corpus(tmp_path, np.random.default_rng(6)), seq_len=32)
    ld = loader(ds, num_workers=2)
    assert len(take(ld)) > 10  # a whole pass
    assert [t.name for t in exits] == ["streamforge-workers-exit"]
    assert len(take(ld, 5)) == 5  # the next pass, left early
    assert exits[1] is threading.main_thread()
    assert at_fork == [[], []]
    workers._join_exits()
    assert not workers._exits


def test_the_interpreter_exits_after_joining_the_workers_of_its_last_pass(tmp_path):
    """A script whose last act is a pass with workers exits cleanly, its worker processes
    reaped before it ends. Its workers inherit ``numpy.random`` from it (imported before the
    fork), where each would otherwise import it when torch seeds numpy in it."""
    import json
    import os
    import subprocess
    import sys

    from helpers.pipeline import make_corpus

    corpus = {name: (url, None) for name, (url, _) in make_corpus(tmp_path, np.random.default_rng(7)).items()}
    script = f"""
import json, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from helpers.pipeline import dataset, loader, take
import streamforge.loader.workers as workers
pids, before, at_fork = [], "numpy.random" in sys.modules, []
real = workers._start_workers
def start(dl):
    it = real(dl)
    at_fork.append("numpy.random" in sys.modules)
    pids.extend(w.pid for w in it._workers)
    return it
workers._start_workers = start
n = len(take(loader(dataset({corpus!r}, seq_len=32), num_workers=2)))
print(json.dumps({{"batches": n, "pids": pids, "numpy.random": [before, at_fork]}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["batches"] > 10 and len(out["pids"]) == 2
    assert out["numpy.random"] == [False, [True]]
    for pid in out["pids"]:  # reaped by the script (a child left over would be re-parented)
        assert not os.path.exists(f"/proc/{pid}"), pid


def test_workers_are_stopped_in_place_when_no_thread_can_start(tmp_path, monkeypatch):
    """Where no new thread can start (the interpreter is shutting down), the pass stops and
    joins its workers itself."""
    from helpers.pipeline import dataset, loader, make_corpus, take

    exits = _exits_on(monkeypatch)
    real_start = threading.Thread.start

    def start(self):
        if self.name == "streamforge-workers-exit":
            raise RuntimeError("can't create new thread at interpreter shutdown")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    ds = dataset(make_corpus(tmp_path, np.random.default_rng(8)), seq_len=32)
    assert len(take(loader(ds, num_workers=2))) > 10
    assert exits == [threading.main_thread()]


@pytest.mark.parametrize("packing", ["concat", "bestfit", "pad"])
def test_a_pipeline_builds_its_tokens_where_it_is_told(tmp_path, packing):
    """``next_batch(out=...)`` gives the batch it gives without, its tokens in ``out``, to the
    pass's end (where a short or padded batch gets its own array), whatever ``out`` held."""
    from helpers.pipeline import dataset, make_corpus

    ds = dataset(make_corpus(tmp_path, np.random.default_rng(3)), seq_len=32, packing=packing)
    plain, told = ds.make_pipeline(0, 1), ds.make_pipeline(0, 1)
    shape, placed = (4, 33), 0
    while True:
        out = np.full(shape, 777, ds.token_dtype)
        want, got = plain.next_batch(4), told.next_batch(4, out)
        if want is None:
            assert got is None
            break
        _same(got, want)
        placed += np.shares_memory(got.tokens, out)
    assert placed > 0
