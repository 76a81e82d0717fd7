"""tools/peers/latency_proxy.py, the object-storage latency of tools/bench_peers.py and
tools/bench_stall.py, in front of the real moto server (``s3_server``, tests/helpers/s3_server.py): each response waits the fixed delay,
a connection's body comes no faster than the cap (and not far slower), and the counts are the
requests made and the body bytes sent."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

from peers.latency_proxy import LatencyProxy, ProxyProcess  # noqa: E402

pytest.importorskip("moto")
pytest.importorskip("s3fs")


def _client(s3_server, endpoint):
    import s3fs

    return s3fs.S3FileSystem(**s3_server.storage_options(endpoint))


def test_delay_cap_and_counts(s3_server):
    bucket = s3_server.new_bucket("latency")
    small, big = b"x" * 1000, os.urandom(3 << 20)
    fs = s3_server.filesystem()
    fs.pipe(f"{bucket}/small", small)
    fs.pipe(f"{bucket}/big", big)

    plain = LatencyProxy(s3_server.endpoint_url, delay_ms=0, bandwidth_mbps=0).start()
    slow = LatencyProxy(s3_server.endpoint_url, delay_ms=60, bandwidth_mbps=15).start()
    try:
        times = {}
        for name, proxy in (("plain", plain), ("slow", slow)):
            client = _client(s3_server, proxy.endpoint_url)
            client.cat_file(f"{bucket}/small")  # the connection made, outside the clock
            proxy.reset()
            t0 = time.perf_counter()
            for _ in range(3):
                assert client.cat_file(f"{bucket}/small") == small
            t1 = time.perf_counter()
            assert client.cat_file(f"{bucket}/big") == big
            t2 = time.perf_counter()
            times[name] = ((t1 - t0) / 3, t2 - t1)
            counts = proxy.counts()
            # s3fs asks HEAD before each GET: 4 GETs among 8 requests, every one counted
            assert counts["gets"] == 4 and counts["requests"] == 8, counts
            assert counts["bytes"] == 3 * len(small) + len(big), counts
        # each small read (a HEAD and a GET) waited the 60 ms delay twice (a lower bound: a
        # loaded machine only adds to it, to the pass-through's time as well)
        assert times["slow"][0] >= 0.12, times
        # 3 MiB at 15 MB/s: 0.21 s at least, plus the delay; the pass-through is far faster
        expect = len(big) / 15e6 + 0.12
        assert expect * 0.95 <= times["slow"][1] <= expect * 2.5 + 0.3, times
        assert times["plain"][1] < expect, times  # the pass-through is not capped
    finally:
        plain.stop()
        slow.stop()


def test_proxy_process_counts_and_stops(s3_server):
    bucket = s3_server.new_bucket("latency")
    s3_server.filesystem().pipe(f"{bucket}/obj", b"y" * 5000)
    proc = ProxyProcess(s3_server.endpoint_url, [(0, 0), (20, 100)])
    try:
        for endpoint in proc.endpoints:
            proc.reset(endpoint)
            client = _client(s3_server, endpoint)
            t0 = time.perf_counter()
            assert client.cat_file(f"{bucket}/obj") == b"y" * 5000
            took = time.perf_counter() - t0
            counts = proc.counts(endpoint)
            assert counts["gets"] >= 1 and counts["bytes"] == 5000, counts
        assert took >= 0.02  # the second proxy's delay
    finally:
        proc.stop()
    assert proc.proc.returncode is not None
