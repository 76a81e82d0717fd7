"""A fresh start's first reads go out beside the plan's (``PackedTokenDataset.start_first_reads``):
the record index and the first bytes of the shard global worker 0 starts in are requested
while the plan still waits for the index of the shard a cut falls in, each once for the
job's processes; the head asks for about the first shuffle window's bytes, and the other
shards' indexes wait for it; the batches are the ones read without them (real S3 server on
127.0.0.1, behind a proxy that delays each answer as a region would)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from helpers.fault_proxy import FaultProxy
from helpers.storage import batches, equal, make_docs, write_corpus
from streamforge import PackedTokenDataset, Stream, StreamingLoader
from streamforge.source import ShardSource
from streamforge.source.readahead import HEAD_BYTES
from streamforge.storage.fetch import ByteFetcher

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from peers.latency_proxy import LatencyProxy  # noqa: E402

DELAY_MS = 150


@pytest.fixture(scope="module")
def s3_corpus(s3_server):
    """Shards of some 400 documents each: the first window (256) is read from the first shard."""
    url = f"s3://{s3_server.new_bucket()}/web"
    opts = s3_server.storage_options()
    manifest = write_corpus(url, make_docs(count=1500, max_len=100), opts, shard_size="400KiB")
    assert manifest.num_shards >= 3 and min(manifest.columns["num_records"][:-1]) > 256
    return url, opts, manifest


def _loader(url, opts, num_workers):
    ds = PackedTokenDataset(Stream(url, storage_options=opts), seq_len=64, seed=3, eos_id=0)
    return StreamingLoader(ds, batch_size=2, num_workers=num_workers)


def _first_and_cut_shards(loader):
    """The shard global worker 0 starts in, and the one the cut between the two workers falls in."""
    layout = loader.dataset.planner.layout(0, 0, 2)
    first = int(layout.order[np.flatnonzero(layout.rec > 0)[0]])
    (cut,) = layout.cut_shards([1])
    return first, cut


def _recorder():
    """``(reads, timed, real)``: ``timed`` stands for ``ByteFetcher.read`` (``real``) and appends
    ``(name, start, stop, began, ended)`` to ``reads`` for each read, from any thread."""
    reads, lock = [], threading.Lock()
    real = ByteFetcher.read

    def timed(self, name, start, stop, **kwargs):
        began = time.perf_counter()
        try:
            return real(self, name, start, stop, **kwargs)
        finally:
            with lock:
                reads.append((name, start, stop, began, time.perf_counter()))

    return reads, timed, real


def test_the_first_shards_index_and_head_go_out_while_the_plan_reads_a_cut(s3_server, s3_corpus, monkeypatch):
    url, opts, manifest = s3_corpus
    reads, timed, real = _recorder()
    proxy = LatencyProxy(s3_server.endpoint_url, delay_ms=DELAY_MS, bandwidth_mbps=0).start()
    try:
        slow = {**opts, "client_kwargs": {"endpoint_url": proxy.endpoint_url}}
        loader = _loader(url, slow, num_workers=2)
        first, cut = _first_and_cut_shards(loader)
        assert first != cut  # the corpus is cut in another shard than the first one
        monkeypatch.setattr(ByteFetcher, "read", timed)
        it = iter(loader)
        batch = next(it)  # the head start, in this process: no worker process has started yet
        del it
    finally:
        proxy.stop()
    monkeypatch.setattr(ByteFetcher, "read", real)

    cols = manifest.columns
    names = manifest.shard_names
    index_of = {s: (names[s], int(cols["index_offset"][s]), int(cols["bytes"][s])) for s in (first, cut)}
    (cut_read,) = [r for r in reads if r[:3] == index_of[cut]]
    (first_index,) = [r for r in reads if r[:3] == index_of[first]]
    (head,) = [r for r in reads if r[0] == names[first] and r[1] == 0]
    # both went out while the cut's index was on its way: one round trip for the three
    assert first_index[3] < cut_read[4] and head[3] < cut_read[4], reads
    assert len(reads) == 3, reads  # nothing else before the first batch, nothing twice

    monkeypatch.setattr(PackedTokenDataset, "start_first_reads", lambda self, pass_idx: None)
    without = next(iter(_loader(url, opts, num_workers=2)))
    assert all(np.array_equal(batch[k].numpy(), without[k].numpy()) for k in batch)


def test_the_workers_read_no_index_the_training_process_read(s3_server, s3_corpus):
    url, opts, manifest = s3_corpus
    clean = batches(_loader(url, opts, num_workers=2))
    proxy = FaultProxy(s3_server.endpoint_url, rate=0).start()
    try:
        logged = {**opts, "client_kwargs": {"endpoint_url": proxy.endpoint_url}}
        assert equal(batches(_loader(url, logged, num_workers=2)), clean)
        log = list(proxy.log)
    finally:
        proxy.stop()
    cols = manifest.columns
    index_reads = {}
    for method, path, range_, _, _ in log:
        for s, name in enumerate(manifest.shard_names):
            if method == "GET" and path.endswith("/" + name) and range_ == f"bytes={int(cols['index_offset'][s])}-{int(cols['bytes'][s]) - 1}":
                index_reads[s] = index_reads.get(s, 0) + 1
    # the head start's indexes are handed to the workers it forks (``keep_indexes``)
    assert index_reads and max(index_reads.values()) == 1, index_reads


@pytest.fixture(scope="module")
def wide_corpus(s3_server):
    """Shards of 1 MiB of random ids (they compress little): a first window of 16 documents
    is a small part of the first shard."""
    rng = np.random.default_rng(5)
    docs = [rng.integers(1, 60000, size=int(n)) for n in rng.integers(500, 3000, size=1200)]
    url = f"s3://{s3_server.new_bucket()}/wide"
    opts = s3_server.storage_options()
    manifest = write_corpus(url, docs, opts, shard_size="1MiB", frame_size="32KiB")
    assert manifest.num_shards >= 3 and int(manifest.columns["index_offset"][0]) > HEAD_BYTES
    return url, opts, manifest


def test_the_head_is_sized_for_the_first_window_and_the_other_indexes_wait(wide_corpus, monkeypatch):
    url, opts, manifest = wide_corpus
    reads, timed, real = _recorder()
    def loader(early: bool):
        ds = PackedTokenDataset(Stream(url, storage_options=opts), seq_len=256, seed=1, shuffle_warmup=16, eos_id=0)
        if not early:
            ds.start_first_reads = lambda pass_idx: None
        return StreamingLoader(ds, batch_size=2, num_workers=0)

    monkeypatch.setattr(ByteFetcher, "read", timed)
    got = batches(loader(early=True), limit=12)
    monkeypatch.setattr(ByteFetcher, "read", real)
    first = int(loader(early=True).dataset.planner.layout(0, 0, 1).order[0])
    name = manifest.shard_names[first]
    (head,) = [r for r in reads if r[0] == name and r[1] == 0]
    stop = head[2]
    assert stop < HEAD_BYTES  # sized for 16 documents, not the default head
    source = ShardSource.open(url, opts)
    index = source.index(first)
    frames = index.frames
    needed = int(frames["comp_offset"][index.frame_of_record(15)] + frames["comp_size"][index.frame_of_record(15)])
    assert needed <= stop  # the first window's frames are all in it
    inside = int((frames["comp_offset"] + frames["comp_size"] <= stop).sum())
    after = int(frames["comp_offset"][inside])
    data = int(manifest.columns["index_offset"][first])
    frame_reads = [r for r in reads if r[0] == name and r[1] < data and r is not head]
    assert frame_reads and all(r[1] >= after for r in frame_reads)  # nothing in the head is read again
    index_at = {n: int(manifest.columns["index_offset"][s]) for s, n in enumerate(manifest.shard_names)}
    (first_index,) = [r for r in reads if r[0] == name and r[1] == index_at[name]]
    others = [r for r in reads if r[0] != name and r[1] == index_at[r[0]]]
    # not beside the first shard's two reads: once one of them is in (the read-ahead's own
    # walk through the plan reads the next shards' indexes once the first one's is in)
    assert others and all(r[3] >= min(head[4], first_index[4]) for r in others), (head, first_index, others)
    source.close()
    assert equal(batches(loader(early=False), limit=12), got)
