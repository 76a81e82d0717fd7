"""The local frame cache: hits on a second pass, LRU eviction, damaged entries, two processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from helpers.storage import config, read_all, same, tokens_of
from streamforge.source import ShardSource
from streamforge.storage.cache import FrameCache


def test_second_pass_is_served_from_the_cache(s3_corpus, docs, tmp_path):
    url, opts, manifest = s3_corpus
    cfg = config(cache_dir=str(tmp_path / "cache"))
    first = ShardSource.open(url, opts, cfg)
    assert same(tokens_of(read_all(first)), docs)
    second = ShardSource.open(url, opts, cfg)
    assert same(tokens_of(read_all(second)), docs)
    stats = second.stats()
    assert stats["cache_hits"] == stats["frames_decoded"] and stats["cache_misses"] == 0
    assert stats["requests"] == manifest.num_shards  # the shard indexes only
    first.close(), second.close()


def test_lru_eviction_at_the_limit(tmp_path):
    cache = FrameCache(str(tmp_path), "stream", limit=10_000)
    for frame in range(8):
        cache.put("shard-000000.tar.zst", frame, bytes([frame]) * 1000)
        os.utime(cache.path("shard-000000.tar.zst", frame), (frame, frame))
    assert cache.get("shard-000000.tar.zst", 0, 1000) is not None  # now most recent
    for frame in range(8, 14):
        cache.put("shard-000000.tar.zst", frame, bytes([frame]) * 1000)
        time.sleep(0.002)
    assert cache.size_bytes() <= 10_000
    kept = {f for f in range(14) if os.path.exists(cache.path("shard-000000.tar.zst", f))}
    assert 0 in kept and 1 not in kept and {11, 12, 13} <= kept
    assert cache.evicted >= 4


def test_damaged_cache_entry_is_fetched_again(corpus, docs, tmp_path):
    _, url, opts, manifest = corpus
    cfg = config(cache_dir=str(tmp_path / "cache"), prefetch_bytes=0)
    read_all(ShardSource.open(url, opts, cfg))
    cache = FrameCache(cfg.cache_dir, manifest.fingerprint)
    flipped = cache.path(manifest.shard_names[1], 1)
    blob = bytearray(open(flipped, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(flipped, "wb").write(bytes(blob))
    os.truncate(cache.path(manifest.shard_names[2], 0), 10)  # and one cut short
    source = ShardSource.open(url, opts, cfg)
    assert same(tokens_of(read_all(source)), docs)
    stats = source.stats()
    assert stats["cache_corrupt"] == 2 and not source.skipped
    assert FrameCache(cfg.cache_dir, manifest.fingerprint).get(
        manifest.shard_names[1], 1, len(blob)) == open(flipped, "rb").read()


def _reader(url, opts, cache_dir, limit, queue):
    source = ShardSource.open(url, opts, config(cache_dir=cache_dir, cache_limit=limit))
    for _ in range(2):
        got = read_all(source)
    queue.put((tokens_of(got), source.stats()["cache_hits"]))


def test_two_processes_share_the_cache(s3_corpus, docs, tmp_path):
    url, opts, manifest = s3_corpus
    limit = manifest.num_bytes  # the frames fit; the second pass hits
    ctx = mp.get_context("fork")  # as DataLoader workers start on Linux
    queue = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(url, opts, str(tmp_path), limit, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for tokens, hits in results:
        assert same(tokens, docs) and hits > 0
    FrameCache(str(tmp_path), manifest.fingerprint, limit).evict()
    assert FrameCache(str(tmp_path), manifest.fingerprint).size_bytes() <= limit
