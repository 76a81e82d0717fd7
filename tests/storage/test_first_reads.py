"""A fresh start's first reads go out beside the plan's (``PackedTokenDataset.start_first_reads``):
the record index and the first bytes of the shard global worker 0 starts in are requested
while the plan still waits for the index of the shard a cut falls in, each once for the
job's processes, and the first batch is the one read without them (real S3 server on
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


def test_the_first_shards_index_and_head_go_out_while_the_plan_reads_a_cut(s3_server, s3_corpus, monkeypatch):
    url, opts, manifest = s3_corpus
    reads, lock = [], threading.Lock()
    real = ByteFetcher.read

    def timed(self, name, start, stop, **kwargs):
        began = time.perf_counter()
        try:
            return real(self, name, start, stop, **kwargs)
        finally:
            with lock:
                reads.append((name, start, stop, began, time.perf_counter()))

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
