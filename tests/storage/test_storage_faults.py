"""Transient faults: retried, counted, invisible in the output; exhausted retries are clear."""

from __future__ import annotations

import errno
import importlib.util
import re

import pytest

from helpers.fault_proxy import FaultProxy
from helpers.storage import config, read_all, same, tokens_of
from streamforge.errors import ManifestError, ShardCorruptError, StorageError
from streamforge.source import ShardSource
from streamforge.storage.config import RetryPolicy
from streamforge.storage.retry import Retrier, ShortRead, is_transient

# each S3 client the readers can use: s3fs, signed HTTP, and obstore where installed
CLIENTS = ["fsspec", "http"] + (["obstore"] if importlib.util.find_spec("obstore") else [])
QUICK = RetryPolicy(attempts=3, backoff_base=0.01, backoff_max=0.02, timeout=0.5, throttle_wait=0)  # SlowDown: an attempt


@pytest.fixture
def proxy(s3_server, request):
    rate, kinds = getattr(request, "param", (0.05, None))
    kw = {"kinds": kinds} if kinds else {}
    p = FaultProxy(s3_server.endpoint_url, rate=rate, seed=11, stall_s=1.5, **kw).start()
    yield p
    p.stop()


def through(proxy, opts):
    return {**opts, "client_kwargs": {"endpoint_url": proxy.endpoint_url}}


@pytest.mark.parametrize(
    "exc, transient",
    [
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (ShortRead("cut"), True),
        (OSError(errno.EBUSY, "SlowDown"), True),
        (OSError(errno.EIO, "InternalError"), True),
        (FileNotFoundError(), False),
        (PermissionError(), False),
        (OSError(errno.EINVAL, "InvalidRange"), False),
        (ShardCorruptError("bad"), False),
        (ManifestError("bad"), False),
        (ValueError("bug"), False),
    ],
)
def test_is_transient(exc, transient):
    assert is_transient(exc) is transient


def test_retrier_backs_off_counts_and_names_what_it_read():
    waits = []
    retrier = Retrier(RetryPolicy(attempts=4, backoff_base=0.1, backoff_max=0.25, jitter=0.0), waits.append)
    calls = iter([ConnectionResetError("reset"), TimeoutError("slow"), b"ok"])

    def request():
        item = next(calls)
        if isinstance(item, Exception):
            raise item
        return item

    assert retrier(request, "s3://b/web/shard-000000.tar.zst frame 3") == b"ok"
    assert waits == [0.1, 0.2] and retrier.retries == 2

    def always():
        raise ConnectionResetError("reset")

    with pytest.raises(StorageError, match=r"shard-000000.tar.zst frame 3: giving up after 4"):
        retrier(always, "s3://b/web/shard-000000.tar.zst frame 3")
    assert waits[-1] == 0.25  # capped at backoff_max


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("prefetch", [0, 64 << 10])
def test_full_read_through_faults_equals_fault_free(s3_corpus, docs, proxy, prefetch, client):
    url, opts, _ = s3_corpus
    source = ShardSource.open(url, through(proxy, opts), config(prefetch_bytes=prefetch, client=client))
    got = read_all(source)
    clean = read_all(ShardSource.open(url, opts, config(prefetch_bytes=0)), plan=False)
    assert same(tokens_of(got), tokens_of(clean)) and same(tokens_of(got), docs)
    assert [(s, r) for s, r, _ in got] == [(s, r) for s, r, _ in clean]
    assert proxy.total_faults > 0
    assert source.stats()["retries"] >= sum(
        n for k, n in proxy.faults.items() if k != "stall"
    ) - 1  # every fault on a data read is one retry (one may hit the manifest)
    source.close()


@pytest.mark.parametrize("proxy", [(0.3, ("reset", "slowdown", "truncate"))], indirect=True)
@pytest.mark.parametrize("client", CLIENTS)
def test_heavy_faults_still_exact(s3_corpus, docs, proxy, client):
    url, opts, _ = s3_corpus
    source = ShardSource.open(url, through(proxy, opts), config(client=client))
    assert same(tokens_of(read_all(source)), docs)
    assert source.stats()["retries"] > 5
    source.close()


@pytest.mark.parametrize("proxy", [(0.0, None)], indirect=True)
@pytest.mark.parametrize("prefetch", [0, 64 << 10])
def test_every_request_failing_names_url_shard_frame(s3_corpus, proxy, prefetch):
    url, opts, _ = s3_corpus
    source = ShardSource.open(url, through(proxy, opts), config(prefetch_bytes=prefetch, retry=QUICK))
    source.index(2)  # the index is read; from here on every request fails
    proxy.rate = 1.0
    proxy.kinds = ("reset", "slowdown", "truncate")
    source.plan_reads([(2, 0, 10)])
    with pytest.raises(StorageError) as info:
        source.read(2, 3, 7)
    text = " ".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert url in text and "shard-000002.tar.zst" in text and re.search(r"frames? \d", text)
    assert "records" in text and "giving up after 3 attempts" in text
    source.close()


@pytest.mark.parametrize("proxy", [(1.0, ("stall",))], indirect=True)
@pytest.mark.parametrize("client", CLIENTS)
def test_stalls_past_the_timeout_are_retried_then_reported(s3_corpus, proxy, client):
    url, opts, _ = s3_corpus
    policy = RetryPolicy(attempts=2, backoff_base=0.01, timeout=0.3)
    with pytest.raises(StorageError, match="index.json: giving up after 2 attempts"):
        ShardSource.open(url, through(proxy, opts), config(retry=policy, client=client))
