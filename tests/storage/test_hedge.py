"""Hedged reads: a stalled request gets a twin and the reader does not wait out the timeout."""

from __future__ import annotations

import threading
import time

import pytest

from helpers.fault_proxy import FaultProxy
from helpers.storage import config, read_all, same, tokens_of
from streamforge.errors import ConfigError
from streamforge.source import ShardSource
from streamforge.storage.config import HedgePolicy, RetryPolicy
from streamforge.storage.fetch import ByteFetcher
from streamforge.storage.hedge import Hedger

FAST = HedgePolicy(minimum=0.02, initial=0.1, warmup=2)


def test_a_slow_first_attempt_is_answered_by_its_twin():
    calls = []
    lock = threading.Lock()

    def request(settled):
        with lock:
            calls.append(time.perf_counter())
            first = len(calls) == 1
        time.sleep(2.0 if first else 0.01)
        return "slow" if first else "fast"

    hedger = Hedger(FAST)
    start = time.perf_counter()
    assert hedger.run(request, 100) == "fast"
    assert time.perf_counter() - start < 1.0
    assert len(calls) == 2 and calls[1] - calls[0] >= FAST.initial * 0.9
    assert (hedger.hedged, hedger.twin_won) == (1, 1)


def test_fast_reads_are_sent_once_and_set_the_threshold():
    hedger = Hedger(FAST)
    count = []
    for _ in range(10):
        assert hedger.run(lambda settled: count.append(1) or b"x", 100) == b"x"
    assert len(count) == 10 and hedger.hedged == 0
    assert hedger.threshold(100) == FAST.minimum  # fast reads: the floor
    assert hedger.threshold(8 << 20) == FAST.initial  # no large read seen yet


def test_both_attempts_failing_raise_the_first_error():
    calls = []

    def request(settled):
        calls.append(1)
        n = len(calls)
        time.sleep(0.3 if n == 1 else 0.0)
        raise ConnectionResetError(f"attempt {n}")

    with pytest.raises(ConnectionResetError, match="attempt 1"):
        Hedger(FAST).run(request, 10)


def test_a_failed_twin_leaves_the_first_attempt_to_answer():
    calls = []

    def request(settled):
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionResetError("twin")
        time.sleep(0.3)
        return "first"

    assert Hedger(FAST).run(request, 10) == "first"


def test_disabled_and_local_reads_are_never_hedged(tmp_path):
    hedger = Hedger(HedgePolicy(enabled=False))
    assert hedger.run(lambda settled: time.sleep(0.6) or 1, 10) == 1 and hedger.hedged == 0
    assert ByteFetcher(str(tmp_path)).hedger is None
    assert ByteFetcher(f"file://{tmp_path}").hedger is None
    assert ByteFetcher("s3://bucket/web").hedger is not None


@pytest.mark.parametrize("bad", [{"factor": 0}, {"minimum": -1}, {"window": 0}, {"warmup": 9, "window": 4}])
def test_bad_hedge_policies_are_refused(bad):
    with pytest.raises(ConfigError, match="HedgePolicy"):
        HedgePolicy(**bad)


def test_stalled_reads_are_hedged_instead_of_waiting_out_the_timeout(s3_corpus, docs):
    url, opts, _ = s3_corpus
    proxy = FaultProxy(opts["client_kwargs"]["endpoint_url"], rate=0.15, seed=3, kinds=("stall",), stall_s=3.0).start()
    try:
        through = {**opts, "client_kwargs": {"endpoint_url": proxy.endpoint_url}}
        retry = RetryPolicy(attempts=4, backoff_base=0.01, backoff_max=0.02, timeout=2.5)
        source = ShardSource.open(url, through, config(prefetch_bytes=0, retry=retry, hedge=FAST))
        start = time.perf_counter()
        got = read_all(source, plan=False)
        seconds = time.perf_counter() - start
        stats = source.stats()
        source.close()
    finally:
        proxy.stop()
    assert same(tokens_of(got), docs)
    stalls = proxy.faults["stall"]
    assert stalls >= 2 and stats["hedged"] >= 1 and stats["hedge_won"] >= 1
    # without hedging every stalled read would cost the 2.5 s timeout before its retry
    assert seconds < stalls * retry.timeout / 2, (seconds, stalls, stats)


def test_an_infinite_reader_reads_ahead_across_the_pass_boundary(tmp_path, docs):
    from helpers.storage import full_ranges, write_corpus
    from streamforge.stages.read import ShardReader

    url = str(tmp_path / "web")
    write_corpus(url, docs)
    source = ShardSource.open(url, None, config(prefetch_bytes=1 << 20))
    ranges = full_ranges(source)
    reader = ShardReader(source, ranges_for=lambda p: ranges, stream_key="web", infinite=True)
    seen = []
    for _ in range(3):  # three passes, 37 records at a time
        while not reader.pass_done:
            batch = reader.read(37)
            seen.extend(batch.doc(i).copy() for i in range(len(batch)))
        prefetcher = source._readahead.prefetcher
        generation = prefetcher._generation
        assert reader.next_pass()
    assert same(seen, list(docs) * 3)
    # the plan was announced once and extended at each boundary, never replaced
    assert prefetcher._generation == generation == 1
    # every frame came through the read-ahead: none was requested outside its plan (a count
    # of the reader's waits would depend on how the threads were scheduled)
    counters = source.counters
    assert counters["frames_decoded"] > 0 and counters["prefetch_hits"] == counters["frames_decoded"]
    source.close()


def test_the_losing_attempt_stops_retrying_once_the_race_is_settled():
    from streamforge.storage.retry import Retrier

    settled = threading.Event()
    settled.set()
    calls = []

    def request():
        calls.append(1)
        raise ConnectionResetError("reset")

    with pytest.raises(ConnectionResetError):
        Retrier(RetryPolicy(attempts=5, backoff_base=0.0))(request, "s3://b/web/shard-000000.tar.zst", settled)
    assert len(calls) == 1


def test_a_request_left_running_never_holds_the_process_open():
    import subprocess
    import sys

    code = (
        "import time\n"
        "from streamforge.storage.pool import DaemonPool\n"
        "pool = DaemonPool(2, 'sf-read')\n"
        "pool.submit(time.sleep, 60)\n"
        "assert pool.submit(lambda: 7).result(timeout=5) == 7\n"
    )
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    assert time.perf_counter() - start < 20
