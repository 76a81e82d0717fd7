"""A restored shuffle window reads its frames in the order its documents leave: the first
batch after a resume waits for the frames of its own documents, not for the whole window's."""

import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.pipeline import assert_batches_equal, dataset, loader, random_docs, take, write_stream
from streamforge.stages.window_reads import restore_units
from streamforge.storage.config import StorageConfig


def _frames_read(ld) -> int:
    return ld.stats()["streams"]["web"]["frames_decoded"]


@pytest.mark.parametrize("prefetch", [0, 1 << 20])
def test_a_restore_reads_the_frames_of_its_first_batch_first(tmp_path, rng, prefetch):
    url = str(tmp_path / "web")
    write_stream(url, random_docs(rng, 1200, 40, min_len=1), shard_size="64KiB", frame_size="4KiB")
    corpus = {"web": (url, None)}
    build = lambda: loader(dataset(corpus, seq_len=32, shuffle_buffer=400, shuffle_warmup=0,
                                   storage=StorageConfig(prefetch_bytes=prefetch)))
    reference = take(build(), 120)
    first = build()
    take(first, 20)  # inside the first window of 400 documents (about 100 frames of 4 records)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = build()
    resumed.load_state_dict(state)
    assert resumed.resume_report.mode == "exact"
    got = take(resumed, 1)
    if prefetch == 0:  # frames are read only when asked for: the first batch's few
        window_frames = first.stats()["streams"]["web"]["frames_decoded"]
        assert 0 < _frames_read(resumed) * 4 < window_frames, (_frames_read(resumed), window_frames)
    got += take(resumed, 99)
    assert_batches_equal(got, reference[20:])


@pytest.mark.parametrize("workers", [0, 2])
def test_restores_at_every_position_of_a_window_are_exact(tmp_path, rng, workers):
    url = str(tmp_path / "web")
    write_stream(url, random_docs(rng, 500, 30, min_len=1), frame_size="1KiB")
    corpus = {"web": (url, None)}
    build = lambda: loader(dataset(corpus, seq_len=32, shuffle_buffer=64, shuffle_warmup=8), num_workers=workers)
    reference = take(build(), 80)
    for at in (1, 2, 5, 9, 17, 33, 50):
        first = build()
        take(first, at)
        resumed = build()
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert_batches_equal(take(resumed, 80 - at), reference[at:])


class _Index:
    """A shard index with ``per_frame`` records in each frame, for ``restore_units``."""

    def __init__(self, num_records: int, per_frame: int) -> None:
        self.num_records, self.per_frame = num_records, per_frame
        starts = np.arange(0, num_records, per_frame)
        self.frames = {"first_record": starts}
        self.first_records = starts

    def frame_of_record(self, record):
        return np.asarray(record) // self.per_frame

    def record_stop(self, frame: int) -> int:
        return min(self.num_records, (frame + 1) * self.per_frame)


class _Source:
    def __init__(self, sizes, per_frame):
        self.indexes = [_Index(n, per_frame) for n in sizes]

    def index(self, shard):
        return self.indexes[shard]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(1, 9), st.randoms(), st.integers(0, 30))
def test_restore_units_cover_each_pending_document_once_in_order_of_need(sizes, per_frame, rnd, skip_hint):
    source = _Source(sizes, per_frame)
    ranges = []
    for s, n in enumerate(sizes):
        a = rnd.randrange(n)
        ranges.append((s, a, rnd.randrange(a + 1, n + 1)))
    docs = [(s, r) for s, a, b in ranges for r in range(a, b)]
    rnd.shuffle(docs)
    skip = min(skip_hint, len(docs) - 1)
    pending = docs[skip:]
    shard = np.array([s for s, _ in pending], np.int64)
    record = np.array([r for _, r in pending], np.int64)
    units = restore_units(source, ranges, shard, record, skip)
    firsts = [u.positions[0] for u in units]
    assert firsts == sorted(firsts)  # read in the order their first document is needed
    placed = {}
    for s, lo, hi, positions, records in units:
        assert positions == sorted(positions)
        frame = source.index(s).frame_of_record(lo)
        for p, r in zip(positions, records):
            assert lo <= r < hi and source.index(s).frame_of_record(r) == frame  # one frame a read
            placed[p] = (s, r)
    assert placed == {skip + i: d for i, d in enumerate(pending)}  # each pending document once


def _restore_at(tmp_path, rng, at: int, **settings):
    """A one-stream corpus of small frames, a loader saved after ``at`` batches inside its first
    window, and a builder of loaders over it."""
    url = str(tmp_path / "web")
    write_stream(url, random_docs(rng, 1200, 40, min_len=1), shard_size="64KiB", frame_size="4KiB")
    corpus = {"web": (url, None)}
    build = lambda: loader(dataset(corpus, seq_len=32, shuffle_buffer=400, shuffle_warmup=0, **settings))
    first = build()
    reference = take(first, at + 40)
    first = build()
    take(first, at)
    return url, build, json.loads(json.dumps(first.state_dict())), reference[at:]


def test_without_read_ahead_a_restore_fetches_its_first_batch_side_by_side(tmp_path, rng, monkeypatch):
    """With read-ahead off (the head start's setting) the frames of a restored window's first
    batch are fetched and decoded together, on threads that are all gone when the read is."""
    from streamforge.source.readahead import ReadAhead

    calls = []
    real = ReadAhead.fetch_now

    def spy(self, ranges, threads):
        real(self, ranges, threads)
        calls.append((len(ranges), threads, [t.name for t in threading.enumerate() if t.name.startswith("sf-fetch-now")]))

    monkeypatch.setattr(ReadAhead, "fetch_now", spy)
    _, build, state, want = _restore_at(tmp_path, rng, 20, storage=StorageConfig(prefetch_bytes=0))
    resumed = build()
    resumed.load_state_dict(state)
    got = take(resumed, 40)
    assert calls and calls[0][0] >= 2 and calls[0][1] >= 2, calls
    assert all(not alive for _, _, alive in calls), calls  # every thread joined before returning
    assert_batches_equal(got, want)


def test_a_damaged_frame_fetched_side_by_side_fails_its_read_with_where(tmp_path, rng):
    from streamforge.errors import ShardCorruptError
    from streamforge.source.shard_source import ShardSource

    url, build, state, _ = _restore_at(tmp_path, rng, 20, storage=StorageConfig(prefetch_bytes=0))
    source = ShardSource.open(url)
    for shard, name in enumerate(source.manifest.shard_names):
        frames = source.index(shard).frames
        with open(f"{url}/{name}", "r+b") as f:
            for offset, size in zip(frames["comp_offset"].tolist(), frames["comp_size"].tolist()):
                f.seek(offset + size // 2)
                byte = f.read(1)
                f.seek(offset + size // 2)
                f.write(bytes([byte[0] ^ 0xFF]))
    resumed = build()
    resumed.load_state_dict(state)
    with pytest.raises(ShardCorruptError, match=r"shard-\d+\.tar\.zst frame \d+.*does not decode"):
        take(resumed, 1)


def test_a_window_order_is_computed_once_and_shared(tmp_path, rng):
    from streamforge.source.shard_source import ShardSource
    from streamforge.stages.window_order import nonempty_order, window_order, window_records

    url = str(tmp_path / "web")
    write_stream(url, [d if i % 7 else d[:0] for i, d in enumerate(random_docs(rng, 300, 20, min_len=1))],
                 shard_size="4KiB", frame_size="1KiB")
    source = ShardSource.open(url)
    ranges = [(1, 3, 30), (0, 0, 12)]
    first = window_order(source, ranges, 42, keep=True)  # a check of a saved state
    shard, record, lengths = window_records(source, ranges)
    for got, want in zip(first, (shard, record, lengths, nonempty_order(lengths, 42))):
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable  # shared: nobody may change it
    assert window_order(ShardSource.open(url), ranges, 42) is not first  # another stream object
    assert window_order(source, ranges, 43)[3].tolist() != first[3].tolist()
    assert window_order(source, [list(r) for r in ranges], 42) is first  # the restore takes it...
    again = window_order(source, ranges, 42)
    assert again is not first  # ...so nothing is held after it
    assert all(np.array_equal(a, b) for a, b in zip(again, first))
