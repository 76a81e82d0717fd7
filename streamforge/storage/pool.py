"""A small pool of daemon threads for background storage requests.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so a
request left running in the background (the losing half of a hedged read, an index read ahead
of a reader that stopped) would hold the training process open until its socket timeout, and
its retries after that. ``DaemonPool`` threads never hold the process: what they were doing
is dropped at exit. Threads start on the first ``submit``; ``close`` drops queued work.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


def serve(jobs: queue.Queue | queue.SimpleQueue, handle: Callable[..., Any]) -> None:
    """A background thread's loop: ``handle(*job)`` for each job until a None arrives. A thread
    waiting for its next job holds nothing of its last one (a read's bytes, a fetched unit)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        handle(*job)
        job = None


class DaemonPool:
    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.cancel()
                return future
            self._queue.put((future, fn, args))
            if len(self._started) < self.threads:
                thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._started)}", daemon=True)
                self._started.append(thread)
                thread.start()
        return future

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while True:
                try:
                    future, _, _ = self._queue.get_nowait()
                except queue.Empty:
                    break
                future.cancel()
            for _ in self._started:
                self._queue.put(None)

    def _work(self) -> None:
        serve(self._queue, self._run)

    @staticmethod
    def _run(future: Future, fn: Callable[..., Any], args: tuple) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)
