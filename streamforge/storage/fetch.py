"""Ranged reads of shard bytes, retried.

``ByteFetcher`` is the one door through which shard bytes enter streamforge: every read is a
``(name, start, stop)`` byte range of a file under the stream's URL, fetched with one ranged
request and retried under the ``RetryPolicy``. A retry asks again for the same range, which
always starts at a frame boundary at or after the reader's current frame, never at the shard
start. Reads from an object store are hedged (``hedge.Hedger``): one still running well past
its peers' latency gets a twin request, and the first answer wins. A short body is a transient
fault (retried) unless the object itself is shorter than the manifest says, or the file is
local: then the shard is truncated and ``ShardCorruptError`` names it at once. So does a range
past the end the manifest gives the shard, and a shard the manifest lists but storage lacks.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any, Callable

from ..errors import ShardCorruptError
from .config import HedgePolicy, RetryPolicy
from .hedge import Hedger
from .open import is_local, join, open_url
from .retry import Retrier, ShortRead


class FetchStats:
    """Counters shared by the fetch threads of one reader (updated under a lock)."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes_fetched = 0
        self.obstore_requests = 0  # of ``requests``, those answered by obstore's client
        self.http_requests = 0  # ... and those answered by storage/s3http.py's
        self._lock = threading.Lock()

    def add(self, requests: int, nbytes: int, client: str | None = None) -> None:
        with self._lock:
            self.requests += requests
            self.bytes_fetched += nbytes
            if client == "obstore":
                self.obstore_requests += requests
            elif client == "http":
                self.http_requests += requests

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


class ByteFetcher:
    """Fetch byte ranges of the files of one stream prefix; picklable, opens lazily."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        hedge: HedgePolicy | None = None,
        client: str = "auto",
    ) -> None:
        self.url = str(url).rstrip("/")
        self.client = client
        self.storage_options = dict(storage_options or {})
        self.policy = retry or RetryPolicy()
        self.retrier = Retrier(self.policy)
        self.local = is_local(self.url)
        self.hedger = None if self.local else Hedger(hedge or HedgePolicy())
        self.stats = FetchStats()
        self._fs = None
        self._path = None
        self._pid = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fs"] = None
        state["_path"] = None
        state["_pid"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def retries(self) -> int:
        return self.retrier.retries

    @property
    def hedged(self) -> int:
        """Reads that got a twin request (0 for local files)."""
        return 0 if self.hedger is None else self.hedger.hedged

    @property
    def hedge_won(self) -> int:
        """Hedged reads answered by the twin first."""
        return 0 if self.hedger is None else self.hedger.twin_won

    def _open(self):
        with self._lock:
            # a client is opened per process: one inherited through fork is not reused (an
            # obstore client would hang there; storage/objstore.py)
            if self._fs is None or self._pid != os.getpid():
                self._fs, self._path = open_url(self.url, self.storage_options, self.policy, self.client)
                self._pid = os.getpid()
        return self._fs, self._path

    def read(
        self,
        name: str,
        start: int,
        stop: int,
        *,
        what: str | None = None,
        file_size: int | None = None,
    ) -> bytes:
        """Bytes ``[start, stop)`` of ``name``; exactly ``stop - start`` of them or an error.

        ``what`` names the shard/frame/records for error messages; ``file_size`` is the size
        the manifest gives the file, checked when a read comes back short.
        """
        where = what or f"{self.url}/{name}"
        if not 0 <= start <= stop or (file_size is not None and stop > file_size):
            # the range comes from an index or a manifest: past the file's end is damage, not
            # something a retry can fix
            size = "" if file_size is None else f" of a {file_size}-byte shard"
            raise ShardCorruptError(f"{where}: bytes {start}..{stop} are not a range{size}")
        fs, path = self._open()
        target = join(path, name)
        client = getattr(fs, "client", None)

        def request() -> bytes:
            try:
                data = fs.cat_file(target, start=start, end=stop)
            except OSError as exc:
                if exc.errno == errno.EINVAL and file_size is not None:  # S3 416 InvalidRange
                    self._check_size(fs, target, where, file_size)
                raise
            self.stats.add(1, len(data), client)
            if len(data) != stop - start:
                if file_size is not None:
                    self._check_size(fs, target, where, file_size)
                if self.local:  # a local file read short is cut, not a body lost in transit
                    raise ShardCorruptError(f"{where}: asked for bytes {start}..{stop}, the file holds {len(data)} of them")
                raise ShortRead(f"{where}: asked for bytes {start}..{stop}, got {len(data)}")
            return data

        try:
            if self.hedger is None:
                return self.retrier(request, where)
            return self.hedger.run(lambda settled: self.retrier(request, where, settled), stop - start)
        except FileNotFoundError as exc:
            raise ShardCorruptError(f"{where}: the manifest lists this shard, but it is not there ({exc})") from exc

    def _check_size(self, fs, target: str, where: str, file_size: int) -> None:
        size = self.retrier(lambda: fs.size(target), where)
        if size != file_size:
            raise ShardCorruptError(
                f"{where}: shard is {size} bytes, the manifest says {file_size} (truncated or "
                "replaced)"
            )

    def size(self, name: str) -> int:
        fs, path = self._open()
        return self.retrier(lambda: fs.size(join(path, name)), f"{self.url}/{name}")


def fetch_frames(
    fetcher: ByteFetcher, cache, name: str, offsets, sizes, first: int, stop: int, *,
    file_size: int, describe: Callable[[int, int], str], use_cache: bool = True,
) -> list[tuple[memoryview, bool]]:
    """Compressed bytes of frames ``first..stop-1`` of file ``name``, frame ``f`` being bytes
    ``offsets[f]..offsets[f]+sizes[f]``: from ``cache`` (a ``FrameCache`` or None) when it
    holds them, else one ranged request per run of missing frames, stored in the cache.
    Returns ``[(buffer, from_cache), ...]``; ``describe(f, g)`` names frames ``f..g-1``."""
    out: list = [None] * (stop - first)
    if cache is not None and use_cache:
        for f in range(first, stop):
            data = cache.get(name, f, int(sizes[f]))
            if data is not None:
                out[f - first] = (memoryview(data), True)
    f = first
    while f < stop:
        if out[f - first] is not None:
            f += 1
            continue
        g = f
        while g < stop and out[g - first] is None:
            g += 1
        lo, hi = int(offsets[f]), int(offsets[g - 1] + sizes[g - 1])
        blob = fetcher.read(name, lo, hi, what=describe(f, g), file_size=file_size)
        out[f - first : g - first] = cut_frames(blob, lo, offsets, sizes, f, g, cache, name)
        f = g
    return out


def cut_frames(blob, lo: int, offsets, sizes, first: int, stop: int, cache, name: str) -> list:
    """Frames ``first..stop-1`` of file ``name`` cut from ``blob``, the file's bytes from
    offset ``lo``, as ``[(buffer, False), ...]`` (views, no copy); each stored in ``cache``
    (a ``FrameCache`` or None)."""
    view, out = memoryview(blob), []
    for f in range(first, stop):
        a = int(offsets[f]) - lo
        piece = view[a : a + int(sizes[f])]
        out.append((piece, False))
        if cache is not None:
            cache.put(name, f, piece)
    return out
