"""End to end through the loader: S3 behind the fault proxy equals fault-free; exact resume."""

from __future__ import annotations

import pytest

from helpers.fault_proxy import FaultProxy
from helpers.storage import FAST_RETRY, batches, equal
from streamforge import PackedTokenDataset, Stream, StreamingLoader
from streamforge.storage.config import StorageConfig


def loader_for(url, opts, num_workers=0, **storage):
    storage.setdefault("retry", FAST_RETRY)
    storage.setdefault("request_bytes", 16 << 10)
    ds = PackedTokenDataset(
        [Stream(url, weight=1.0, name="web", storage_options=opts)],
        seq_len=128, seed=0, shuffle_buffer=64, packing="concat", eos_id=0,
        storage=StorageConfig(**storage),
    )
    return StreamingLoader(ds, batch_size=4, num_workers=num_workers)






@pytest.mark.parametrize("num_workers", [0, 2])
def test_full_pass_through_faults_is_bit_identical(s3_corpus, s3_server, num_workers):
    url, opts, _ = s3_corpus
    clean = batches(loader_for(url, opts, num_workers))
    proxy = FaultProxy(s3_server.endpoint_url, rate=0.05, seed=5, stall_s=1.5).start()
    try:
        faulty_opts = {**opts, "client_kwargs": {"endpoint_url": proxy.endpoint_url}}
        loader = loader_for(url, faulty_opts, num_workers)
        assert equal(batches(loader), clean) and len(clean) > 10
        assert proxy.total_faults > 0
        assert _total(loader.stats(), "retries") > 0
    finally:
        proxy.stop()


def test_exact_resume_from_s3(s3_corpus):
    url, opts, _ = s3_corpus
    full = batches(loader_for(url, opts))
    loader = loader_for(url, opts)
    head = batches(loader, limit=7)
    state = loader.state_dict()
    resumed = loader_for(url, opts)
    resumed.load_state_dict(state)
    assert equal(head + batches(resumed), full)


def _total(stats, key):
    """Sum of ``key`` anywhere in the (nested) stats dict the loader reports."""
    if isinstance(stats, dict):
        return sum(v if k == key and isinstance(v, (int, float)) else _total(v, key)
                   for k, v in stats.items())
    return 0
