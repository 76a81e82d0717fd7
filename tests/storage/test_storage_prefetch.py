"""Fetch units: how planned frames are grouped into requests (no files, no threads)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import itertools

from streamforge.storage.prefetch import FetchUnit, group_frames, ramp


def test_units_fill_up_to_the_cap_and_a_large_frame_stands_alone():
    comp = np.array([4, 4, 4, 20, 4])
    raw = comp * 3
    units = list(group_frames(7, 2, 0, 5, comp, raw, cap=10))
    assert [(u.first, u.stop) for u in units] == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert units[0] == FetchUnit(7, 2, 0, 2, 8 + 24)  # compressed plus decoded bytes
    assert all(u.range_idx == 7 and u.shard == 2 for u in units)


def test_a_new_plan_starts_with_small_units():
    assert list(itertools.islice(ramp(10, first=2), 6)) == [2, 4, 8, 10, 10, 10]
    assert list(itertools.islice(ramp(3, first=8), 2)) == [3, 3]
    comp = np.full(8, 4)
    units = list(group_frames(0, 0, 0, 8, comp, comp, ramp(16, first=4)))
    assert [(u.first, u.stop) for u in units] == [(0, 1), (1, 3), (3, 7), (7, 8)]


@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    cap=st.integers(1, 120),
    held_cap=st.none() | st.integers(1, 300),
    data=st.data(),
)
def test_units_cover_the_frames_once_in_order(sizes, cap, held_cap, data):
    comp = np.array(sizes)
    raw = comp * 3
    first = data.draw(st.integers(0, len(sizes)))
    stop = data.draw(st.integers(first, len(sizes)))
    units = list(group_frames(0, 0, first, stop, comp, raw, cap, held_cap))
    covered = [f for u in units for f in range(u.first, u.stop)]
    assert covered == list(range(first, stop))
    for u in units:
        held = comp[u.first : u.stop].sum() + raw[u.first : u.stop].sum()
        assert u.nbytes == held
        if u.stop - u.first > 1:
            assert comp[u.first : u.stop].sum() <= cap
            assert held_cap is None or held <= held_cap


def test_a_unit_holds_at_most_a_quarter_of_the_read_ahead(tmp_path, rng):
    """Compressed plus decoded, each unit of a plan fits four times in the budget, so the
    scheduler keeps several in flight ahead of the reader (a unit larger than what the
    budget has left waits until the reader has taken everything)."""
    from helpers.pipeline import random_docs, write_stream

    from streamforge.format.manifest import Manifest
    from streamforge.source import ShardSource
    from streamforge.source.readahead import UNITS_IN_BUDGET
    from streamforge.storage.config import StorageConfig
    from streamforge.storage.fetch import ByteFetcher

    url = str(tmp_path / "s")
    write_stream(url, random_docs(rng, 400, 2000), shard_size="1MiB", frame_size="32KiB")
    budget = 1 << 20
    source = ShardSource(Manifest.load(url), ByteFetcher(url), config=StorageConfig(prefetch_bytes=budget))
    plan = [(s, 0, int(n)) for s, n in enumerate(source.manifest.columns["num_records"])]
    units = list(source._readahead._units(plan))
    assert len(units) > 8
    assert max(u.nbytes for u in units if u.stop - u.first > 1) <= budget // UNITS_IN_BUDGET
    source.close()


def test_a_read_finds_its_place_in_the_plan_near_the_cursor_or_anywhere(tmp_path, rng):
    """A read looks for its planned range a few ranges from the last one first; one far from
    it (behind, or past them) is found all the same, and a range not planned is not."""
    from helpers.pipeline import random_docs, write_stream

    from streamforge.format.manifest import Manifest
    from streamforge.source import ShardSource
    from streamforge.source.readahead import _NEAR
    from streamforge.storage.config import StorageConfig
    from streamforge.storage.fetch import ByteFetcher

    url = str(tmp_path / "s")
    write_stream(url, random_docs(rng, 300, 50), shard_size="4KiB", frame_size="1KiB")
    source = ShardSource(Manifest.load(url), ByteFetcher(url), config=StorageConfig(prefetch_bytes=1 << 20))
    plan = [(s, a, a + 1) for s, n in enumerate(source.manifest.columns["num_records"].tolist()) for a in range(n)]
    assert len(plan) > 4 * _NEAR
    ahead = source._readahead
    ahead._plan, ahead._plan_by_shard, ahead._plan_cursor = plan, None, 0
    for j in (0, 1, 3, 3 * _NEAR, len(plan) - 1, 2, 2 * _NEAR + 1):  # near, far ahead, far behind
        shard, start, _ = plan[j]
        assert ahead._plan_pos(shard, start) == j and ahead._plan_cursor == j
    assert ahead._plan_pos(source.manifest.num_shards + 5, 0) is None
    source.close()


class _Frame(bytearray):
    """A frame buffer that can be watched with a weak reference."""


def test_taken_and_passed_frames_are_freed_at_once():
    """Once the reader took a frame (or moved past it), no fetch thread keeps its bytes: the
    budget bounds what a reader holds, so a finished unit must not stay alive in a thread."""
    import gc
    import time
    import weakref

    from streamforge.storage.prefetch import Prefetcher

    made: list[weakref.ref] = []

    def fetch(unit):
        out = [_Frame(1000) for _ in range(unit.first, unit.stop)]
        made.extend(weakref.ref(b) for b in out)
        return out

    pf = Prefetcher(fetch, budget=10_000, threads=3)
    units = [FetchUnit(i, 0, 2 * i, 2 * i + 2, 2000) for i in range(12)]
    pf.plan(units)
    try:
        for u in units:
            got = pf.take((0, u.first), (u.range_idx, u.first))  # frame u.stop-1 is passed
            assert isinstance(got, _Frame)
            del got
        assert isinstance(pf.take((0, 23), (11, 23)), _Frame)  # the last frame, taken too
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            gc.collect()
            alive = [r for r in made if r() is not None]
            if not alive:
                break
            time.sleep(0.01)
        assert len(made) == 24
        assert alive == [], f"{len(alive)} frame buffers still alive after the reader took or passed them"
    finally:
        pf.close()


def test_fetched_frames_count_what_they_hold_against_the_budget():
    """A unit is planned at an estimate (compressed plus decoded bytes); once fetched, its
    frames count what they keep, so the budget buys as much read-ahead as it says."""
    import time

    from streamforge.storage.prefetch import Prefetcher

    def fetch(unit):
        return [bytes(100) for _ in range(unit.first, unit.stop)]

    pf = Prefetcher(fetch, budget=2_700, threads=2, held=len)
    units = [FetchUnit(i, 0, 2 * i, 2 * i + 2, 1_000) for i in range(8)]  # estimate 500 a frame
    pf.plan(units)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and pf.held_bytes != 16 * 100:
            time.sleep(0.01)
        # all 8 units fit: 16 frames of 100 bytes, though their estimates sum to 8,000
        assert pf.held_bytes == 16 * 100
        for u in units:
            assert pf.take((0, u.first), (u.range_idx, u.first)) == bytes(100)
        assert pf.take((0, 15), (7, 15)) == bytes(100)
        assert pf.held_bytes == 0
    finally:
        pf.close()


def test_the_reader_s_waits_and_the_fetch_threads_busy_time_are_counted():
    """``wait_seconds``: the reader's time in ``take`` until its frame is there, planned or in
    flight (``waits`` counts only the scheduler being behind); ``busy_seconds``: the fetch
    threads' time in fetch. A frame fetched before the reader asks costs no wait."""
    import threading
    import time

    from streamforge.storage.prefetch import Prefetcher

    gate = threading.Event()

    def fetch(unit):
        if unit.range_idx == 0:
            gate.wait(10)  # in flight until the test lets it go, with the reader waiting
        time.sleep(0.05)
        return [bytes(10) for _ in range(unit.first, unit.stop)]

    pf = Prefetcher(fetch, budget=1 << 20, threads=1)
    units = [FetchUnit(0, 0, 0, 1, 20), FetchUnit(1, 0, 1, 2, 20)]
    pf.plan(units)
    try:
        got = []
        reader = threading.Thread(target=lambda: got.append(pf.take((0, 0), (0, 0))))
        reader.start()
        time.sleep(0.3)  # the reader is waiting for frame 0 by now
        gate.set()
        reader.join(10)
        assert got == [bytes(10)]
        assert pf.wait_seconds >= 0.05  # at least the fetch's last 0.05 s, after the gate opened
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not pf._entries[(0, 1)].done:
            time.sleep(0.01)
        waited = pf.wait_seconds
        assert pf.take((0, 1), (1, 1)) == bytes(10)  # fetched already: no wait
        assert pf.wait_seconds == waited
        assert pf.busy_seconds >= 0.1  # each unit's fetch took 0.05 s or more
    finally:
        gate.set()
        pf.close()


@pytest.mark.parametrize("help_reader", [True, False])
def test_a_waiting_reader_fetches_the_queued_units_of_its_read_itself(help_reader):
    """With ``help_reader`` (local files), a reader waiting for a frame in flight takes the
    queued units its read needs (up to ``until``) off the queue and fetches them on its own
    thread, so the decoding behind a wait runs on two cores; the frames it fetched are handed
    out as any other, and a unit past its read is left to the fetch threads. Without it (an
    object store), every unit is fetched by the fetch threads."""
    import threading
    import time

    from streamforge.storage.prefetch import Prefetcher

    gate = threading.Event()
    fetched_by = {}

    def fetch(unit):
        fetched_by[unit.range_idx] = threading.current_thread().name
        if unit.range_idx == 0:
            gate.wait(10)  # in flight until the reader has had time to help
        return [bytes([unit.range_idx]) * 10 for _ in range(unit.first, unit.stop)]

    pf = Prefetcher(fetch, budget=1 << 20, threads=1, help_reader=help_reader)
    pf.plan([FetchUnit(i, 0, i, i + 1, 20) for i in range(4)])
    try:
        reader = threading.current_thread().name
        threading.Timer(0.5, gate.set).start()
        assert pf.take((0, 0), (0, 0), until=(2, 2)) == bytes([0]) * 10  # a read of frames 0..2
        assert [pf.take((0, i), (i, i)) for i in (1, 2, 3)] == [bytes([i]) * 10 for i in (1, 2, 3)]
        assert fetched_by[0] == fetched_by[3] == "sf-fetch-0"
        helped = [i for i in (1, 2) if fetched_by[i] == reader]
        assert helped == ([1, 2] if help_reader else [])
    finally:
        gate.set()
        pf.close()


def test_local_indexes_are_read_ahead_on_one_thread(tmp_path, rng):
    """A local index read is a pread: one thread keeps ahead of the reader, where each more
    one holds a malloc arena of its own (an object store's stream gets ``INDEX_THREADS``)."""
    from helpers.pipeline import random_docs, write_stream

    from streamforge.format.manifest import Manifest
    from streamforge.source import ShardSource
    from streamforge.source.readahead import INDEX_THREADS, INDEX_THREADS_LOCAL
    from streamforge.storage.config import StorageConfig
    from streamforge.storage.fetch import ByteFetcher

    url = str(tmp_path / "s")
    write_stream(url, random_docs(rng, 300, 400), shard_size="16KiB", frame_size="4KiB")
    source = ShardSource(Manifest.load(url), ByteFetcher(url), config=StorageConfig(prefetch_bytes=64 << 10))
    ranges = [(s, 0, int(n)) for s, n in enumerate(source.manifest.columns["num_records"])]
    assert len(ranges) > 8  # more shards than a pool of INDEX_THREADS would need threads for
    source.plan_reads(ranges)
    for s, a, b in ranges:
        source.read(s, a, b)
    pool = source._readahead._index_pool
    assert pool is not None and pool.threads == INDEX_THREADS_LOCAL == 1
    assert len(pool._started) == 1
    source.close()
    # an object store's stream: the head read and the indexes side by side
    source._readahead.source.fetcher.local = False
    source._readahead._index_pool = None
    assert source._readahead._pool().threads == INDEX_THREADS > 1
    source._readahead.close()
