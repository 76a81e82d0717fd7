"""503 SlowDown: backed off with decorrelated jitter, apart from the attempts, for a bounded
time; a pass through a proxy that throttles above a request rate (as S3 does per prefix)
completes with every record delivered once, and the time it took is printed."""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest

from helpers.fault_proxy import FaultProxy
from helpers.storage import config, read_all, same, tokens_of
from streamforge import PackedTokenDataset, Stream, StreamingLoader
from streamforge.errors import StorageError
from streamforge.source import ShardSource
from streamforge.storage.config import RetryPolicy
from streamforge.storage.objstore import error_for_status
from streamforge.storage.retry import Retrier, is_throttle

CLIENTS = ["fsspec", "http"] + (["obstore"] if importlib.util.find_spec("obstore") else [])
SLOW = "s3://b/web/shard-000004.tar.zst frame 2: HTTP 503 SlowDown: Please reduce your request rate."


def _fails(*errors):
    calls = iter(errors)

    def request():
        item = next(calls)
        if isinstance(item, Exception):
            raise item
        return item

    return request


def test_throttle_is_told_from_other_faults():
    assert is_throttle(error_for_status(503, SLOW))
    assert is_throttle(error_for_status(429, "s3://b/k: HTTP 429"))
    assert is_throttle(OSError(5, "An error occurred (SlowDown) when calling GetObject"))
    assert not is_throttle(ConnectionResetError("reset"))
    assert not is_throttle(error_for_status(500, "s3://b/k: HTTP 500 InternalError"))


def test_throttling_backs_off_with_decorrelated_jitter_apart_from_attempts(monkeypatch):
    import random

    import streamforge.storage.retry as retry_module

    # seeded draws: the "growing" check below is about one run's draws (unseeded, CI once drew
    # 12 waits that all stayed under 0.29 s)
    monkeypatch.setattr(retry_module, "random", random.Random(7))
    waits = []
    policy = RetryPolicy(attempts=2, backoff_base=0.1, backoff_max=2.0, throttle_wait=30.0)
    retrier = Retrier(policy, waits.append)
    # 12 SlowDowns and one reset: more than ``attempts`` failures, yet it succeeds
    got = retrier(_fails(*[error_for_status(503, SLOW)] * 12, ConnectionResetError("reset"), b"ok"), "frame")
    assert got == b"ok" and retrier.retries == 13 and retrier.throttled == 12
    throttle_waits = waits[:12]
    previous = 0.0
    for w in throttle_waits:
        assert policy.backoff_base <= w <= min(policy.backoff_max, 3 * max(previous, policy.backoff_base))
        previous = w
    below_cap = [w for w in throttle_waits if w < policy.backoff_max]
    assert len(set(below_cap)) == len(below_cap) >= 3  # jittered: no two waits alike
    assert max(throttle_waits) > 4 * policy.backoff_base  # and growing


def test_throttling_gives_up_after_throttle_wait_naming_the_object():
    waits = []
    policy = RetryPolicy(attempts=3, backoff_base=0.05, backoff_max=1.0, throttle_wait=4.0)

    def always():
        raise error_for_status(503, SLOW)

    with pytest.raises(StorageError) as info:
        Retrier(policy, waits.append)(always, "s3://b/web/shard-000004.tar.zst frame 2")
    assert sum(waits) == pytest.approx(4.0)  # bounded: the last wait is cut to the budget
    assert len(waits) > 3  # not limited by attempts
    text = str(info.value)
    assert "s3://b/web/shard-000004.tar.zst frame 2" in text and "SlowDown" in text
    assert "throttle_wait=4 s" in text and "kept throttling" in text


def test_throttle_wait_zero_makes_a_slowdown_an_attempt():
    policy = RetryPolicy(attempts=2, backoff_base=0.01, throttle_wait=0)
    with pytest.raises(StorageError, match="giving up after 2 attempts"):
        Retrier(policy, lambda s: None)(_fails(*[error_for_status(503, SLOW)] * 3), "x")


@pytest.fixture
def throttling(s3_server):
    """A proxy answering ``503 SlowDown`` to GETs above 10 a second."""
    p = FaultProxy(s3_server.endpoint_url, rate=0.0, limit=10).start()
    yield p
    p.stop()


def _through(proxy, opts):
    return {**opts, "client_kwargs": {"endpoint_url": proxy.endpoint_url}}


@pytest.mark.parametrize("client", CLIENTS)
def test_read_through_a_throttling_proxy_is_exact(s3_corpus, docs, throttling, client):
    url, opts, _ = s3_corpus
    policy = RetryPolicy(backoff_base=0.02, backoff_max=1.0, throttle_wait=60.0)
    start = time.perf_counter()
    source = ShardSource.open(url, _through(throttling, opts), config(prefetch_bytes=0, request_bytes=4 << 10, client=client, retry=policy))
    got = read_all(source)
    seconds = time.perf_counter() - start
    assert same(tokens_of(got), docs)
    gets = sum(1 for m, *_ in throttling.log if m == "GET")
    print(f"\n[throttle] {client}: {len(docs)} records, {gets} GETs ({throttling.faults['slowdown']} answered "
          f"503 SlowDown at 10 GET/s) in {seconds:.2f} s; {source.stats()['retries']} retries")
    assert throttling.faults["slowdown"] > 0
    source.close()


def _records(batches):
    """The (shard, record) of every document start in ``batches`` (provenance segments)."""
    segs = np.concatenate([b["segments"].reshape(-1, 5) for b in batches])
    firsts = segs[(segs[:, 0] >= 0) & (segs[:, 3] == 0)][:, 1:3]
    return {tuple(r) for r in firsts.tolist()}, firsts


def test_a_loader_pass_under_slowdown_delivers_every_record_once(s3_corpus, docs, throttling):
    url, opts, manifest = s3_corpus
    policy = RetryPolicy(backoff_base=0.02, backoff_max=1.0, throttle_wait=60.0)

    def one_pass(storage_options, retry):
        ds = PackedTokenDataset([Stream(url, name="web", storage_options=storage_options)], seq_len=128,
                                shuffle_buffer=64, provenance=True, eos_id=0,
                                storage=config(prefetch_bytes=64 << 10, client="http", retry=retry))
        loader = StreamingLoader(ds, batch_size=2)
        start = time.perf_counter()
        out = [{k: np.asarray(v).copy() for k, v in b.items()} for b in loader]
        return out, time.perf_counter() - start

    clean, clean_s = one_pass(opts, policy)
    got, seconds = one_pass(_through(throttling, opts), policy)
    assert len(got) == len(clean) and all(np.array_equal(a[k], b[k]) for a, b in zip(got, clean) for k in a)
    records, firsts = _records(got)
    assert len(records) == len(firsts) and records == _records(clean)[0]  # each once, as without throttling
    gets = sum(1 for m, *_ in throttling.log if m == "GET")
    print(f"\n[throttle] loader pass: {len(got)} batches, {len(records)} records of {len(docs)} (the pass's "
          f"full batches), {gets} GETs of which {throttling.faults['slowdown']} answered 503 SlowDown at 10 GET/s: "
          f"{seconds:.2f} s against {clean_s:.2f} s unthrottled")
    assert throttling.faults["slowdown"] > 0
