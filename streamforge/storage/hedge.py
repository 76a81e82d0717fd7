"""Hedged reads: a ranged request that is slow next to its peers gets a twin.

A stalled object-store request (a connection that accepts and then says nothing) costs its
full timeout before the retry even starts, and the reader waiting on that frame stalls the
training step for all of it. ``Hedger`` runs each remote read on a small thread pool and, if
it has not returned after ``threshold()`` seconds, sends the same request again; the first
to return wins and the other is left to finish (its bytes are dropped). Reads that return
in time cost one thread hand-off.

The threshold follows the reads themselves: ``factor`` times the 90th percentile of the
last ``window`` completed reads of the same size class (under or over 1 MiB), never less
than ``minimum``; before ``warmup`` reads have completed it is ``initial``. So a healthy
store is almost never hedged (a read must be several times slower than nine in ten of its
recent peers), and a store that is slow everywhere raises its own bar.

Every attempt runs its own retries (``Retrier``), so a hedge is never a substitute for a
retry: it only stops one slow attempt from holding the reader. Once one attempt has answered,
the other stops retrying (``run``'s ``settled`` event); the pool's threads are daemons, so
an attempt still waiting on its socket never holds the process open at exit.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Callable, TypeVar

import numpy as np

from .config import HedgePolicy
from .pool import DaemonPool

T = TypeVar("T")
_LARGE = 1 << 20


class Hedger:
    """Runs reads with a hedge; picklable (the pool and the latency history are per process)."""

    def __init__(self, policy: HedgePolicy, threads: int = 8) -> None:
        self.policy = policy
        self.threads = threads
        self._init_local()

    def _init_local(self) -> None:
        self._pool: DaemonPool | None = None
        self._lock = threading.Lock()
        self._seconds = (deque(maxlen=self.policy.window), deque(maxlen=self.policy.window))
        self.hedged = 0  # reads that got a twin
        self.twin_won = 0  # ... and were answered by it

    def __getstate__(self) -> dict:
        return {"policy": self.policy, "threads": self.threads}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_local()

    def threshold(self, nbytes: int) -> float:
        p = self.policy
        seconds = self._seconds[nbytes >= _LARGE]
        with self._lock:
            if len(seconds) < p.warmup:
                return p.initial
            p90 = float(np.percentile(np.fromiter(seconds, float, len(seconds)), 90))
        return max(p.minimum, p.factor * p90)

    def _timed(self, request: Callable[[threading.Event], T], settled: threading.Event, nbytes: int) -> T:
        start = time.perf_counter()
        out = request(settled)
        with self._lock:
            self._seconds[nbytes >= _LARGE].append(time.perf_counter() - start)
        return out

    def run(self, request: Callable[[threading.Event], T], nbytes: int) -> T:
        """``request(settled)``'s result, from the first of at most two attempts to succeed;
        ``settled`` is set once the race is decided (an attempt should then stop retrying)."""
        settled = threading.Event()
        if not self.policy.enabled:
            return request(settled)
        with self._lock:
            if self._pool is None:
                self._pool = DaemonPool(self.threads, "sf-read")
            pool = self._pool
        first = pool.submit(self._timed, request, settled, nbytes)
        done, _ = wait([first], timeout=self.threshold(nbytes))
        if done:
            return first.result()
        twin = pool.submit(self._timed, request, settled, nbytes)
        with self._lock:
            self.hedged += 1
        pending: set[Future] = {first, twin}
        error: BaseException | None = None
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                if future.exception() is None:
                    settled.set()
                    if future is twin:
                        with self._lock:
                            self.twin_won += 1
                    return future.result()
                if error is None or future is first:
                    error = future.exception()
        raise error  # both attempts failed: the first one's error (retries exhausted)
