"""A local disk cache of compressed frames, shared by processes, evicted least recently used.

Layout: ``<cache_dir>/<stream fingerprint>/<shard key>/<frame>.zst``, one file per frame
holding exactly the frame's compressed bytes. The stream fingerprint is a digest of every
shard's sha256, so a stream rewritten in place never serves stale frames. The shard key is a
digest of the shard's name: no path under ``cache_dir`` is made of manifest text, so no
manifest can place a file outside it.

- **Writes are atomic**: a frame is written to a temporary file in the same directory and
  renamed into place, so a reader in another process or rank sees the whole frame or none.
- **Recency is the file's mtime**, touched on every hit; eviction deletes the oldest files
  until the directory is back under ``cache_limit``. Each process keeps an estimate of the
  total (from its last scan plus its own writes) and rescans when the estimate passes the
  limit or after writing a sixteenth of it, under an ``flock`` so processes do not evict at
  the same time.
- **A damaged entry is caught twice**: its size must match the shard index, and zstd's
  per-frame content checksum is checked when it is decoded; the reader then drops the entry
  and fetches the frame again from the stream (``ShardSource``).
- A frame evicted while another process opens it is simply a miss.
- **The cache never stops a read.** A ``cache_dir`` that cannot be created or used (a
  regular file in the way, no permission, a read-only disk) is reported once, with a warning,
  and the cache is then off for the process: frames come from the stream.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import threading
import uuid

SUFFIX = ".zst"
log = logging.getLogger("streamforge.storage")
_WARNED: set[str] = set()  # cache roots found unusable, warned about once per process
_DIGEST = re.compile(r"[0-9a-f]{8,64}")


def shard_key(shard_name: str) -> str:
    """The directory of a shard's frames: a digest of its name, never the name itself."""
    return hashlib.sha256(shard_name.encode("utf-8", "surrogatepass")).hexdigest()[:24]


class FrameCache:
    """Frames of one stream in ``root``; picklable, no open handles."""

    def __init__(self, root: str, namespace: str, limit: int | None = None) -> None:
        self.root = os.path.abspath(os.path.expanduser(str(root)))
        if not _DIGEST.fullmatch(namespace):  # a stream fingerprint is one already
            namespace = shard_key(namespace)
        self.dir = os.path.join(self.root, namespace)
        self.disabled = False  # set for good when the cache directory turns out unusable
        self.limit = limit
        self.hits = 0
        self.misses = 0
        self.corrupt = 0
        self.evicted = 0
        self._estimate: int | None = None
        self._written_since_scan = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]
        state.update(hits=0, misses=0, corrupt=0, evicted=0, _estimate=None, _written_since_scan=0)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def path(self, shard_name: str, frame: int) -> str:
        return os.path.join(self.dir, shard_key(shard_name), f"{frame:08d}{SUFFIX}")

    def _unusable(self, exc: OSError) -> None:
        """Turn the cache off for good, warning once per process and cache root."""
        self.disabled = True
        if self.root not in _WARNED:
            _WARNED.add(self.root)
            log.warning(
                "frame cache %s cannot be used (%s: %s); reading without it", self.root,
                type(exc).__name__, exc,
            )

    def get(self, shard_name: str, frame: int, size: int) -> bytes | None:
        """The cached bytes of a frame, or None (absent, evicted, the wrong size, or the cache
        off)."""
        path = self.path(shard_name, frame)
        try:
            if self.disabled:
                raise FileNotFoundError(path)
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)
        except FileNotFoundError:
            with self._lock:
                self.misses += 1
            return None
        except OSError as exc:  # not a directory, no permission, an I/O error
            self._unusable(exc)
            with self._lock:
                self.misses += 1
            return None
        if len(data) != size:
            self.drop(shard_name, frame)
            with self._lock:
                self.misses += 1
            return None
        with self._lock:
            self.hits += 1
        return data

    def put(self, shard_name: str, frame: int, data: bytes | memoryview) -> None:
        if self.disabled:
            return
        path = self.path(shard_name, frame)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as exc:
            self._unusable(exc)
            return
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            # A full or read-only disk must not stop training: the cache is an optimization.
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        if self.limit is not None:
            self._account(len(data))

    def drop(self, shard_name: str, frame: int, corrupt: bool = True) -> None:
        try:
            os.unlink(self.path(shard_name, frame))
        except OSError:  # gone already, or the cache unusable (get() reported it)
            pass
        if corrupt:
            with self._lock:
                self.corrupt += 1

    # -- eviction -------------------------------------------------------------------------
    def _account(self, nbytes: int) -> None:
        with self._lock:
            self._written_since_scan += nbytes
            if self._estimate is not None:
                self._estimate += nbytes
            due = (
                self._estimate is None
                or self._estimate > self.limit
                or self._written_since_scan > self.limit // 16
            )
        if due:
            self.evict()

    def evict(self) -> int:
        """Delete least recently used frames until the cache fits ``limit``; returns bytes freed."""
        if self.disabled:
            return 0
        try:
            os.makedirs(self.root, exist_ok=True)
            lock = open(os.path.join(self.root, ".lock"), "a+b")
        except OSError as exc:
            self._unusable(exc)
            return 0
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0  # another process is evicting right now
            try:
                entries, total = self._scan()
                freed = 0
                if self.limit is not None and total > self.limit:
                    entries.sort()
                    for _, size, path in entries:
                        if total - freed <= self.limit:
                            break
                        try:
                            os.unlink(path)
                            freed += size
                            self.evicted += 1
                        except FileNotFoundError:
                            pass
                with self._lock:
                    self._estimate = total - freed
                    self._written_since_scan = 0
                return freed
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _scan(self) -> tuple[list[tuple[float, int, str]], int]:
        """(mtime, size, path) of every cached frame under ``root`` (all streams), and the total."""
        entries = []
        total = 0
        stack = [self.root]
        while stack:
            try:
                it = os.scandir(stack.pop())
            except OSError:  # gone, or not a directory: nothing cached there
                continue
            with it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        elif entry.name.endswith(SUFFIX):
                            st = entry.stat(follow_symlinks=False)
                            entries.append((st.st_mtime, st.st_size, entry.path))
                            total += st.st_size
                    except FileNotFoundError:
                        continue
        return entries, total

    def size_bytes(self) -> int:
        return self._scan()[1]
