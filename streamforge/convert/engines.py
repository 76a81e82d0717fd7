"""Where the tasks of a text conversion run: local processes or a Ray cluster.

Both engines take the same module-level task function, a list of picklable tasks and one
shared value (the tokenizer, a few MB), and yield results as tasks finish, in any order: the
caller orders them by slice. The shared value is sent once per worker process (local) or put
once in the object store (Ray), never once per task.

``local``: a process pool of ``workers`` processes (forked on Linux, so the pool starts in
milliseconds and the shared value is inherited), which die with this process (``lifeline``).

``ray``: connects to ``address`` (``--ray-address``), else to ``RAY_ADDRESS``, else starts a
local cluster; a Ray session the caller already started (``ray.init(...)``) is used as it is.
Each task asks for one CPU. A task whose worker dies is retried by Ray (``max_retries``):
tasks only ever write whole files of deterministic content, so a retry writes the same
bytes. A cluster this engine started itself is shut down when the conversion ends.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterator

from ..errors import ConfigError, StreamforgeError
from .lifeline import die_with_parent, pool_context

ENGINES = ("local", "ray")
RAY_TASK_RETRIES = 3

_SHARED: Any = None


def _init_worker(shared: Any, parent_pid: int) -> None:
    global _SHARED
    _SHARED = shared
    die_with_parent(parent_pid)


def _call(fn: Callable, task: Any) -> Any:
    return fn(task, _SHARED)


class LocalEngine:
    """A pool of ``workers`` processes."""

    name = "local"

    def __init__(self, workers: int, shared: Any) -> None:
        self.workers = workers
        self.pool = ProcessPoolExecutor(
            max_workers=workers, mp_context=pool_context(), initializer=_init_worker,
            initargs=(shared, os.getpid()),
        )

    def run(self, fn: Callable, tasks: list) -> Iterator[Any]:
        futures = [self.pool.submit(_call, fn, task) for task in tasks]
        try:
            for future in as_completed(futures):
                try:
                    yield future.result()
                except BrokenProcessPool as exc:
                    exc.add_note("a worker process died (killed?); rerun the same command to resume")
                    raise
        finally:
            for future in futures:
                future.cancel()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _ray_call(fn: Callable, task: Any, shared: Any) -> Any:
    return fn(task, shared)


class RayEngine:
    """Tasks on a Ray cluster; one CPU each."""

    name = "ray"

    def __init__(self, address: str | None, shared: Any) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ConfigError("--engine ray needs Ray (pip install 'streamforge[ray]')") from exc
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            # address None: RAY_ADDRESS if set, else a new local cluster.
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            self.started = True
        self.shared = ray.put(shared)
        self.remote = ray.remote(num_cpus=1, max_retries=RAY_TASK_RETRIES)(_ray_call)

    def run(self, fn: Callable, tasks: list) -> Iterator[Any]:
        ray = self.ray
        pending = [self.remote.remote(fn, task, self.shared) for task in tasks]
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                try:
                    yield ray.get(done[0])
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, (StreamforgeError, OSError)):
                        raise cause from exc
                    raise
        finally:
            for ref in pending:
                ray.cancel(ref)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


def make_engine(engine: str, workers: int, address: str | None, shared: Any):
    if engine == "local":
        return LocalEngine(workers, shared)
    if engine == "ray":
        return RayEngine(address or os.environ.get("RAY_ADDRESS") or None, shared)
    raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
