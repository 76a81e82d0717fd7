"""The daemon thread pool behind hedged reads and index read-ahead."""

import gc
import time
import weakref

from streamforge.storage.pool import DaemonPool


class _Blob(bytearray):
    """A result that can be watched with a weak reference."""


def test_a_finished_job_is_not_kept_alive_by_its_thread():
    """A hedged read's bytes belong to whoever took them: the thread that fetched them, now
    waiting for its next job, must not keep them alive."""
    pool = DaemonPool(2, "sf-test")
    try:
        refs = []
        for _ in range(4):
            future = pool.submit(lambda: _Blob(1 << 16))
            refs.append(weakref.ref(future.result(timeout=5)))
            del future
        deadline = time.monotonic() + 5
        while any(r() is not None for r in refs) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert [r() for r in refs] == [None] * 4
    finally:
        pool.close()


def test_jobs_after_close_are_cancelled():
    pool = DaemonPool(1, "sf-test")
    pool.close()
    assert pool.submit(lambda: 1).cancelled()
