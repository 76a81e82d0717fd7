"""Run-wide storage settings: retries, prefetch budget, local cache, integrity policy.

All three classes are frozen dataclasses checked in ``__post_init__``, so a bad value fails when
the dataset is built, before training starts.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

from ..errors import ConfigError

VERIFY_MODES = ("size", "sha256")
CLIENTS = ("auto", "obstore", "http", "fsspec")  # what reads s3:// (storage/objstore.py)
ON_ERROR_MODES = ("raise", "skip")


def _check(owner, names, types, ok, wanted: str) -> None:
    """``ConfigError`` naming ``Owner.name`` for the first of ``names`` that is not ``wanted``."""
    for name in names:
        value = getattr(owner, name)
        if isinstance(value, bool) or not isinstance(value, types) or not ok(value):
            raise ConfigError(f"{type(owner).__name__}.{name} must be {wanted}, got {value!r}")


@dataclass(frozen=True)
class RetryPolicy:
    """How transient storage faults are retried.

    Attempt ``k`` (1-based) that fails waits ``min(backoff_max, backoff_base * 2**(k-1))``
    scaled by a random factor in ``[1 - jitter, 1]`` before the next one.

    An answer that says the store is throttling (``503 SlowDown``, ``429``) is not one of the
    ``attempts``: the request backs off with decorrelated jitter (each wait drawn uniformly
    between ``backoff_base`` and three times the previous one, at most ``backoff_max``), so
    that many clients throttled together spread out instead of coming back in step, until
    ``throttle_wait`` seconds of waiting are spent; then it fails with a ``StorageError``
    naming the object and what the store said.

    Args:
        attempts: tries of one request in all, the first included (at least 1).
        backoff_base: seconds waited after the first failed attempt, doubling after each.
        backoff_max: the most seconds waited between two attempts.
        timeout: the per-request socket timeout in seconds (connect and each read) handed to
            the filesystem (> 0).
        jitter: the share of each wait that is randomized, in [0, 1].
        throttle_wait: the most seconds one request waits in all while the store throttles it
            (0: a throttling answer is one of the ``attempts``, like any other fault).
    """

    attempts: int = 8
    backoff_base: float = 0.05
    backoff_max: float = 5.0
    timeout: float = 30.0
    jitter: float = 0.5
    throttle_wait: float = 120.0

    def __post_init__(self) -> None:
        _check(self, ("attempts",), int, lambda v: v >= 1, "an int >= 1")
        _check(self, ("backoff_base", "backoff_max", "timeout", "throttle_wait"), (int, float), lambda v: v >= 0,
               "a number >= 0")
        if self.timeout == 0:
            raise ConfigError("RetryPolicy.timeout must be > 0")
        if not 0 <= self.jitter <= 1:
            raise ConfigError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter!r}")

    def delay(self, attempt: int, unit_random: float) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based); ``unit_random`` in [0, 1)."""
        base = min(self.backoff_max, self.backoff_base * (2 ** (attempt - 1)))
        return base * (1.0 - self.jitter * unit_random)

    def throttle_delay(self, previous: float, unit_random: float) -> float:
        """Seconds to wait after a throttling answer, the previous such wait of the request
        being ``previous`` (0 at first): decorrelated jitter, uniform in
        ``[backoff_base, 3 * max(previous, backoff_base)]``, at most ``backoff_max``."""
        low = self.backoff_base
        high = 3.0 * max(previous, low)
        return min(self.backoff_max, low + (high - low) * unit_random)


@dataclass(frozen=True)
class HedgePolicy:
    """When a read gets a twin: after ``max(minimum, factor * p90)`` of its size class's last
    ``window`` reads (``initial`` until ``warmup`` of them are known).

    Args:
        enabled: False sends every read once.
        factor: the threshold as a multiple of the recent reads' 90th percentile.
        minimum: the least threshold, in seconds.
        initial: the threshold, in seconds, until ``warmup`` reads have completed.
        window: completed reads of each size class the percentile is taken over.
        warmup: completed reads needed before the percentile is used (at most ``window``).
    """

    enabled: bool = True
    factor: float = 3.0
    minimum: float = 0.05
    initial: float = 0.5
    window: int = 64
    warmup: int = 8

    def __post_init__(self) -> None:
        _check(self, ("factor", "minimum", "initial"), (int, float), lambda v: v > 0, "a number > 0")
        _check(self, ("window", "warmup"), int, lambda v: v >= 1, "an int >= 1")
        if self.warmup > self.window:
            raise ConfigError(f"HedgePolicy.warmup ({self.warmup}) must be <= window ({self.window})")


LOCAL_READ_AHEAD = (8 << 20, 1)  # (prefetch_bytes, prefetch_threads) for local files, in a worker process
CROWDED_READ_AHEAD = (0, 1)  # ... in a worker process without a core for its fetch thread (``spare_core``)
TRAINER_READ_AHEAD = (32 << 20, 1)  # for local files, read in the training process (0 workers)
REMOTE_READ_AHEAD = (64 << 20, 4)  # and for object stores
STREAM_READ_AHEAD_FLOOR = 1 << 20  # the least read-ahead a stream of several gets (bytes)


def in_worker() -> bool:
    """Whether this process is a DataLoader worker (torch's ``get_worker_info``, read only
    where torch's data module is already imported: nothing here imports torch)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform says, else all)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def spare_core(cores: int, workers: int, local_ranks: int) -> bool:
    """Whether a DataLoader worker process has a core for a fetch thread beside its own: the
    node's ``local_ranks`` ranks each run ``workers`` worker processes on ``cores`` cores, and
    each worker process wants two (its pipeline, and its fetch thread decoding ahead)."""
    return cores >= 2 * max(1, workers) * max(1, local_ranks)


def _local_ranks() -> int:
    """The ranks on this node, as torchrun says (``LOCAL_WORLD_SIZE``); 1 where it does not."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def worker_has_spare_core() -> bool:
    """``spare_core`` for this DataLoader worker process (call in one: ``in_worker``)."""
    info = sys.modules["torch.utils.data"].get_worker_info()
    return spare_core(usable_cores(), info.num_workers, _local_ranks())


@dataclass(frozen=True)
class StorageConfig:
    """Storage options shared by every stream of a dataset.

    Args:
        prefetch_bytes: budget of bytes a pipeline (one per DataLoader worker) fetches ahead
            of its readers; 0 turns background prefetch off (reads become plain ranged
            requests). None (the default) chooses by where the stream lives and where it is
            read: local files 8 MiB in a DataLoader worker that has a core for its fetch
            thread and none in one that has not, 32 MiB in the training process (0 workers),
            object stores 64 MiB (``read_ahead``). The streams of a mixture share
            it in proportion to their largest weight in the schedule, each at least 1 MiB
            (``stream_read_ahead``), so mixing 30 streams does not hold 30 budgets.
        cache_dir: keep fetched frames on local disk under this directory (None: no cache).
            Safe to share between processes.
        cache_limit: bytes past which the cache evicts the least recently used frames (None:
            no limit; needs ``cache_dir``).
        verify: ``"size"`` checks every frame's size and zstd checksum against the shard
            index, and the index against the manifest; ``"sha256"`` also checks each shard's
            sha256 when a pass reads it from its first frame to its last.
        on_error: ``"raise"`` a ``ShardCorruptError`` for damaged data, or ``"skip"`` the
            damaged records, log them and list them in ``ShardSource.skipped``.
        retry: how transient faults are retried, and the request timeout (``RetryPolicy``).
        request_bytes: the most bytes one background request asks for (frames are grouped
            up to this size, so a 64 MiB shard takes a handful of requests).
        prefetch_threads: background fetch threads per pipeline; None (the default): 1 for
            local files, 4 for object stores; shared by a mixture's streams like the bytes,
            at least one each.
        hedge: when a slow read from an object store gets a second, identical request
            (``HedgePolicy``, storage/hedge.py); local files are never hedged.
        client: what reads ``s3://`` streams: ``"auto"`` (the default) takes obstore's
            client where the options allow it, signed HTTP requests over urllib3 where
            obstore cannot run (not installed, or a worker forked after the trainer used
            it), else s3fs; ``"obstore"`` insists on obstore (HTTP in such a forked worker);
            ``"http"`` on the HTTP requests; ``"fsspec"`` always takes s3fs
            (storage/objstore.py, storage/s3http.py).
    """

    prefetch_bytes: int | None = None
    cache_dir: str | None = None
    cache_limit: int | None = None
    verify: str = "size"
    on_error: str = "raise"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    request_bytes: int = 8 << 20
    prefetch_threads: int | None = None
    hedge: HedgePolicy = field(default_factory=HedgePolicy)
    client: str = "auto"

    def __post_init__(self) -> None:
        if self.prefetch_bytes is not None and (not isinstance(self.prefetch_bytes, int) or self.prefetch_bytes < 0):
            raise ConfigError(f"prefetch_bytes must be None or an int >= 0, got {self.prefetch_bytes!r}")
        if self.cache_limit is not None and (
            not isinstance(self.cache_limit, int) or self.cache_limit <= 0
        ):
            raise ConfigError(f"cache_limit must be a positive int or None, got {self.cache_limit!r}")
        if self.cache_limit is not None and self.cache_dir is None:
            raise ConfigError("cache_limit is set but cache_dir is not")
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if self.on_error not in ON_ERROR_MODES:
            raise ConfigError(f"on_error must be one of {ON_ERROR_MODES}, got {self.on_error!r}")
        if not isinstance(self.retry, RetryPolicy):
            raise ConfigError(f"retry must be a RetryPolicy, got {type(self.retry).__name__}")
        if not isinstance(self.hedge, HedgePolicy):
            raise ConfigError(f"hedge must be a HedgePolicy, got {type(self.hedge).__name__}")
        if not isinstance(self.request_bytes, int) or self.request_bytes <= 0:
            raise ConfigError(f"request_bytes must be a positive int, got {self.request_bytes!r}")
        if self.prefetch_threads is not None and (
            not isinstance(self.prefetch_threads, int) or self.prefetch_threads < 1
        ):
            raise ConfigError(f"prefetch_threads must be None or an int >= 1, got {self.prefetch_threads!r}")
        if self.client not in CLIENTS:
            raise ConfigError(f"client must be one of {CLIENTS}, got {self.client!r}")

    def read_ahead(self, local: bool) -> tuple[int, int]:
        """(bytes, threads) of read-ahead for a reader of local files or of an object store.

        The defaults differ because what read-ahead hides differs. A local read takes
        microseconds, but decoding takes about as long as the rest of the pipeline, and a
        shuffle window wants thousands of documents at once. In a DataLoader worker, 8 MiB
        ahead on one thread decodes much of the next window while the current one is
        packed, and a reader that still waits decodes the next queued frames itself
        (``Prefetcher(help_reader=True)``); the workers run side by side, and a larger budget
        buys them no speed. That takes a core for the fetch thread beside the worker's own:
        where the node's worker processes have fewer than two cores each (``spare_core``),
        the fetch threads only take turns with the pipelines they feed, and each hand-over
        of a frame between threads costs CPU time the pass lacks, so such a worker reads
        and decodes its local frames itself (docs/storage.md gives the figures). In the
        training process (0 workers) the reader also builds the batch contract, and 32 MiB
        (about two windows of frames) lets the fetch thread decode what it would otherwise
        wait for: 1.11x the 8 MiB pass, for 22 MiB more at peak (docs/storage.md,
        "Prefetch"). More threads cost memory (freed frames stay in each thread's malloc
        arena) and contend for the GIL between frames. An object store answers in tens of
        milliseconds, so a deep budget and parallel requests keep its reads ahead of the
        reader, whatever the cores."""
        if not local:
            budget, threads = REMOTE_READ_AHEAD
        elif not in_worker():
            budget, threads = TRAINER_READ_AHEAD
        else:
            budget, threads = LOCAL_READ_AHEAD if worker_has_spare_core() else CROWDED_READ_AHEAD
        return (budget if self.prefetch_bytes is None else self.prefetch_bytes,
                threads if self.prefetch_threads is None else self.prefetch_threads)

    def stream_read_ahead(self, local: bool, share: float) -> tuple[int, int]:
        """(bytes, threads) of read-ahead for one stream holding ``share`` (0..1] of a
        pipeline's (``read_ahead``): its share of the bytes, at least
        ``STREAM_READ_AHEAD_FLOOR`` (or all of them when the budget is smaller), and its
        share of the threads, rounded up. A stream's reader waits only at its own pace,
        so a stream drawn a tenth of the time needs about a tenth of the read-ahead; what
        mixing many streams must not do is hold a whole budget, threads and all, for each."""
        budget, threads = self.read_ahead(local)
        if share >= 1 or budget <= 0:
            return budget, threads
        return (max(min(budget, STREAM_READ_AHEAD_FLOOR), round(budget * share)),
                max(1, math.ceil(threads * share - 1e-9)))
