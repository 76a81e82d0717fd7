"""A fresh plan's first frames read beside the first shard's index (``ReadAhead._read_head``):
the frames inside that read are not requested again, the read never changes a record, and a
shard read from elsewhere than its start, a local shard, a cached one or a failed head read
all read as before (real S3 server on 127.0.0.1)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from helpers.storage import config, read_all, same, tokens_of, write_corpus
from streamforge.errors import StorageError
from streamforge.source import ShardSource
from streamforge.source.readahead import HEAD_BYTES


def _logged(source: ShardSource, fail_head: bool = False) -> list:
    """Log every ranged read of ``source`` as ``(name, start, stop)``; with ``fail_head`` the
    head read of shard 0 fails (every other read goes through)."""
    log, lock = [], threading.Lock()
    read = source.fetcher.read
    head = (source.manifest.shard_names[0], 0, min(HEAD_BYTES, int(source.manifest.columns["index_offset"][0])))

    def logged(name, start, stop, **kwargs):
        with lock:
            log.append((name, start, stop))
        if fail_head and (name, start, stop) == head:
            raise StorageError(f"{name}: injected failure of the head read")
        return read(name, start, stop, **kwargs)

    source.fetcher.read = logged
    return log


def _frame_reads(source: ShardSource, log: list, shard: int) -> list[tuple[int, int]]:
    name = source.manifest.shard_names[shard]
    index_at = int(source.manifest.columns["index_offset"][shard])
    return sorted((a, b) for n, a, b in log if n == name and a < index_at)


def test_the_first_shards_first_frames_are_read_once_beside_its_index(s3_corpus, docs):
    url, opts, manifest = s3_corpus
    source = ShardSource.open(url, opts, config())
    log = _logged(source)
    records = read_all(source)
    assert same(tokens_of(records), docs)
    data = int(manifest.columns["index_offset"][0])
    assert data < HEAD_BYTES  # this corpus's shards fit in the head whole
    assert _frame_reads(source, log, 0) == [(0, data)]  # one request for every frame of shard 0
    assert len(_frame_reads(source, log, 1)) > 1  # later shards: unit by unit, as before
    assert source.stats()["requests"] == len(log)
    source.close()


@pytest.fixture(scope="module")
def large_first_shard(s3_server):
    """A corpus whose first shard holds more compressed bytes than the head (random ids
    compress little)."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 60000, size=int(n)) for n in rng.integers(2000, 6000, size=400)]
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/big"
    opts = s3_server.storage_options()
    manifest = write_corpus(url, docs, opts, shard_size="4MiB", frame_size="64KiB")
    assert int(manifest.columns["index_offset"][0]) > 2 * HEAD_BYTES
    return url, opts, docs


@pytest.mark.parametrize("fail_head", [False, True], ids=["head read", "head read fails"])
def test_a_shard_larger_than_the_head_reads_the_rest_unit_by_unit(large_first_shard, fail_head):
    url, opts, docs = large_first_shard
    source = ShardSource.open(url, opts, config(request_bytes=1 << 20, prefetch_bytes=8 << 20))
    log = _logged(source, fail_head)
    assert same(tokens_of(read_all(source)), docs)
    reads = _frame_reads(source, log, 0)
    head = (0, HEAD_BYTES)
    assert head in reads
    if fail_head:  # the first unit's own request read its frames
        assert [a for a, _ in reads].count(0) == 2
    else:  # the units inside the head were not requested; the rest were, from where it ends
        assert [a for a, _ in reads].count(0) == 1
        rest = [r for r in reads if r != head]
        assert rest and all(a > 0 for a, _ in rest)
        assert sum(b - a for a, b in rest) < int(source.manifest.columns["index_offset"][0])
    source.close()


def test_no_head_read_from_local_disk_a_cached_shard_or_mid_shard(s3_corpus, docs, tmp_path):
    url, opts, manifest = s3_corpus
    local = str(tmp_path / "web")
    write_corpus(local, docs)
    source = ShardSource.open(local, None, config())
    source.plan_reads([(0, 0, 5)])
    assert source._readahead._head is None
    source.close()

    source = ShardSource.open(url, opts, config())
    source.plan_reads([(0, 3, 9)])  # from record 3: its frame's place is in the index only
    assert source._readahead._head is None
    source.close()

    cfg = config(cache_dir=str(tmp_path / "cache"))
    warm = ShardSource.open(url, opts, cfg)
    read_all(warm)
    warm.close()
    cached = ShardSource.open(url, opts, cfg)
    log = _logged(cached)
    assert same(tokens_of(read_all(cached)), docs)
    assert cached._readahead._head is None
    assert len(log) == manifest.num_shards  # the indexes only
    cached.close()


@pytest.mark.parametrize("fail_head", [False, True], ids=["head read", "head read fails"])
def test_without_read_ahead_the_index_and_the_head_are_read_side_by_side(large_first_shard, fail_head):
    """A head start's pipeline reads without read-ahead (no thread may outlive it): its first
    shard's index and head are still read at once (``ReadAhead._head_now``), each request
    held 0.3 s here so that the two overlap whatever the machine's load; no thread is left,
    the frames inside the head are not requested again, and a failed head only costs its
    request."""
    url, opts, docs = large_first_shard
    source = ShardSource.open(url, opts, config(prefetch_bytes=0))
    log = _logged(source, fail_head)
    spans, read = [], source.fetcher.read

    def slow(name, start, stop, **kwargs):
        began = time.monotonic()
        time.sleep(0.3)
        try:
            return read(name, start, stop, **kwargs)
        finally:
            spans.append((began, time.monotonic()))

    source.fetcher.read = slow
    n = int(source.manifest.columns["num_records"][0])
    source.plan_reads([(0, 0, n)])
    assert not [t for t in threading.enumerate() if t.name == "sf-head-index"]  # the index thread was joined
    assert len(spans) == 2 and spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]  # side by side
    first = source.read(0, 0, 4)
    assert same([first.doc(i) for i in range(len(first))], docs[:4])
    reads = _frame_reads(source, log, 0)
    assert (0, HEAD_BYTES) in reads
    assert [a for a, _ in reads].count(0) == (2 if fail_head else 1)
    stats = source.stats()
    assert stats["prefetch_hits"] == (0 if fail_head else stats["frames_decoded"]) and stats["frames_decoded"] > 0
    source.close()
