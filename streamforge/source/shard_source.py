"""Reading shards by frame: the index with one ranged request, records with one more.

``ShardSource`` is the random-access view of one stream. Reading record ``r`` fetches the
shard index (once, cached) and the compressed bytes of the frames holding the wanted
records, never the bytes before them. The bytes come through ``storage/`` (ranged reads with
retries, the frame cache; prefetch through ``readahead.py``) and are decoded by ``format/``
(the index, frames, records into a ``DocBatch``). What this class adds is the policy between
the two: integrity checks against the manifest, and skipping damaged data.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import Future
from typing import Any, Iterable, Iterator

import zstandard

from ..errors import ShardCorruptError, StorageError
from ..format.frames import ShardIndex, decode_frame, decode_index
from ..format.manifest import Manifest
from ..format.reader import DocBatch, check_frame_records, check_index, gather
from ..storage.cache import FrameCache
from ..storage.config import StorageConfig
from ..storage.fetch import ByteFetcher, fetch_frames
from .early import EarlyReads
from .readahead import ReadAhead

log = logging.getLogger("streamforge.storage")


class ShardSource:
    """Random access to the records of one stream, with prefetch, cache and integrity checks.

    Picklable before and after use: threads, the prefetch buffer and filesystem handles are
    created lazily in the process that reads.

    Args:
        manifest: the stream's manifest (its shards, sizes and digests).
        fetcher: the ranged reads of the stream's files (``ByteFetcher``).
        config: storage settings (default ``StorageConfig()``): read-ahead, cache, checks,
            what to do with damaged data.
        read_share: this stream's share (0..1] of its pipeline's read-ahead
            (``StorageConfig.stream_read_ahead``).
    """

    def __init__(
        self, manifest: Manifest, fetcher: ByteFetcher, *, config: StorageConfig | None = None,
        read_share: float = 1.0,
    ) -> None:
        self.manifest = manifest
        self.fetcher = fetcher
        self.config = config or StorageConfig()
        self.read_share = read_share  # of its pipeline's read-ahead (StorageConfig.stream_read_ahead)
        self.dtype = manifest.token_np_dtype()
        self.cache = (
            FrameCache(self.config.cache_dir, manifest.fingerprint, self.config.cache_limit)
            if self.config.cache_dir
            else None
        )
        self._reset()

    def _reset(self) -> None:
        self._indexes: dict[int, ShardIndex] = {}
        self._index_blobs: dict[int, bytes] = {}
        self._index_locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        self._decompressor = None
        self._readahead = ReadAhead(self)
        self._last: tuple[int, int, bytes] | None = None  # last decoded (shard, frame, raw)
        self._hashes: dict[int, tuple[int, Any]] = {}  # shard -> (next offset, sha256 state)
        self._bad_shards: dict[int, str] = {}
        self.skipped: list[dict[str, Any]] = []
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.early = EarlyReads(self)  # reads started before a reader of them exists
        self._lender: ShardSource | None = None  # the source whose early reads this one takes

    def __getstate__(self) -> dict:
        keep = ("manifest", "fetcher", "config", "dtype", "cache", "read_share")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    @classmethod
    def open(
        cls,
        url: str,
        storage_options: dict[str, Any] | None = None,
        config: StorageConfig | None = None,
    ) -> ShardSource:
        """Load the manifest (clear errors for what is wrong) and prepare ranged reads."""
        config = config or StorageConfig()
        manifest = Manifest.load(url, storage_options, retry=config.retry, client=config.client)
        fetcher = ByteFetcher(url, storage_options, config.retry, config.hedge, config.client)
        return cls(manifest, fetcher, config=config)

    @property
    def on_error(self) -> str:
        """What a damaged record does: ``"raise"`` or ``"skip"`` (``StorageConfig.on_error``)."""
        return self.config.on_error

    def close(self) -> None:
        self._readahead.close()

    # -- naming -----------------------------------------------------------------------------
    def where(self, shard: int, frame: int | tuple[int, int] | None = None, records=None) -> str:
        """``url/shard-000001.tar.zst frame 3 records 120..179``: every error says this much."""
        text = f"{self.fetcher.url}/{self.manifest.shard_names[shard]}"
        if isinstance(frame, tuple):
            a, b = frame
            text += f" frame {a}" if b == a + 1 else f" frames {a}..{b - 1}"
        elif frame is not None:
            text += f" frame {frame}"
        if records is not None:
            text += f" records {records[0]}..{records[1] - 1}"
        return text

    # -- shard index ------------------------------------------------------------------------
    def has_index(self, shard: int) -> bool:
        """Whether shard ``shard``'s record index was read already (no I/O)."""
        return shard in self._indexes

    def index(self, shard: int) -> ShardIndex:
        cached = self._indexes.get(shard)
        if cached is not None:
            return cached
        lender = self._lender
        if lender is not None and shard in lender.early.indexes:  # read (or being read) there
            cached = lender.index(shard)
            if self.config.verify == "sha256":
                blob = lender._index_blobs.get(shard)
                if blob is None:
                    return self._own_index(shard)
                self._index_blobs[shard] = blob
            self._indexes[shard] = cached
            return cached
        return self._own_index(shard)

    def _own_index(self, shard: int) -> ShardIndex:
        if shard in self._bad_shards:
            raise ShardCorruptError(self._bad_shards[shard])
        with self._lock:
            lock = self._index_locks.setdefault(shard, threading.Lock())
        with lock:
            cached = self._indexes.get(shard)
            if cached is None:
                cached = self._fetch_index(shard)
                self._indexes[shard] = cached
        return cached

    def adopt_indexes(self, other: ShardSource) -> None:
        """Take the record indexes that ``other``, a source of the same stream in this process,
        has read. An index never changes, so the sources of one process share what any of
        them fetched (the planner's, the state checks', the head start's, and a forked
        worker's from its parent's) instead of each paying a request for it. The reads
        ``other`` started early (``EarlyReads``) are taken from it too, finished or not."""
        if other is self or other.manifest is not self.manifest:
            return
        if other.early.started:
            self._lender = other
        sha256 = self.config.verify == "sha256"
        for shard, index in list(other._indexes.items()):
            blob = other._index_blobs.get(shard)
            if shard in self._indexes or (sha256 and blob is None):  # a shard's hash needs its index's bytes
                continue
            self._indexes[shard] = index
            if sha256:
                self._index_blobs[shard] = blob

    def early_head(self, shard: int) -> tuple[int, Future, int, int | None] | None:
        """``(shard, head read, bytes, records)`` started early for shard ``shard`` (``EarlyReads.start``),
        here or at the source this one adopted its indexes from, taken at most once; else None."""
        for source in (self, self._lender):
            got = None if source is None else source.early.take_head(shard)
            if got is not None:
                return got
        return None

    def _fetch_index(self, shard: int) -> ShardIndex:
        col = self.manifest.columns
        start = int(col["index_offset"][shard])
        stop = start + int(col["index_bytes"][shard])
        where = self.where(shard)
        blob = self.fetcher.read(
            self.manifest.shard_names[shard], start, stop, what=f"{where} index",
            file_size=int(col["bytes"][shard]),
        )
        self.counters["index_requests"] += 1
        index = decode_index(blob, where)
        check_index(index, self.manifest, shard, where)
        if self.config.verify == "sha256":
            self._index_blobs[shard] = blob
        return index

    # -- planning and prefetch ----------------------------------------------------------------
    def plan_reads(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        """Announce the ``(shard, start_record, stop_record)`` ranges about to be read, in order.

        Their frames are fetched in the background, at most ``prefetch_bytes`` ahead of the
        reads. A new call replaces the plan. Reads outside the plan still work.
        """
        self._readahead.plan(ranges)

    def extend_reads(self, ranges: Iterable[tuple[int, int, int]]) -> int:
        """Announce more ranges, read after every planned one, keeping what is prefetched.
        Returns how many ranges the plan now holds."""
        self._readahead.extend(ranges)
        return len(self._readahead._plan)

    def fetch_now(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        """Fetch and decode the frames of the ``(shard, start, stop)`` ranges about to be read,
        side by side, before returning (``ReadAhead.fetch_now``); nothing where read-ahead
        is on (its threads fetch the planned ranges already; ``ranges`` is then not even
        consumed) or for fewer than two ranges."""
        budget, threads = self._readahead.budget()
        if budget > 0:
            return
        ranges = list(ranges)
        if len(ranges) >= 2:
            self._readahead.fetch_now(ranges, max(2, threads))

    # -- fetching frames ----------------------------------------------------------------------
    def fetch_frames(self, shard: int, first: int, stop: int, index: ShardIndex, use_cache=True):
        """Compressed bytes of frames ``first..stop-1``: from the cache, else one request per run
        of missing frames. Returns ``[(buffer, from_cache), ...]``."""
        frames = index.frames

        def describe(f: int, g: int) -> str:
            records = (int(frames["first_record"][f]), index.record_stop(g - 1))
            return self.where(shard, (f, g), records)

        return fetch_frames(
            self.fetcher, self.cache, self.manifest.shard_names[shard], frames["comp_offset"],
            frames["comp_size"], first, stop, file_size=int(self.manifest.columns["bytes"][shard]),
            describe=describe, use_cache=use_cache,
        )

    def _obtain(self, shard: int, first: int, stop: int, start: int, index: ShardIndex) -> list:
        """``[(buffer, from_cache) or None (decoded already), ...]`` for frames first..stop-1."""
        out: list = [None] * (stop - first)
        last = self._last
        # the frame decoded last is reused only at either end of the range: in the middle it
        # would split one ranged request into two
        held = last[1] if last is not None and last[0] == shard and last[1] in (first, stop - 1) else None
        wanted = [f for f in range(first, stop) if f != held]
        missing = []
        for f, buf in zip(wanted, self._readahead.take(shard, start, wanted, index)):
            if buf is None:
                missing.append(f)
            else:
                out[f - first] = buf
                self.counters["prefetch_hits"] += 1
        for f0, f1 in _runs(missing):
            out[f0 - first : f1 - first] = self.fetch_frames(shard, f0, f1, index)
        return out

    # -- decoding and checks ------------------------------------------------------------------
    def _decode(self, shard: int, f: int, got, index: ShardIndex) -> bytes:
        if self._decompressor is None:
            self._decompressor = zstandard.ZstdDecompressor()
        buf, from_cache = got[0], got[1]
        raw_size = int(index.frames["raw_size"][f])
        checked = len(got) > 2 and got[2] is not None  # decoded and checked by the read-ahead
        try:
            raw = got[2] if checked else None
            if raw is None:
                raw = decode_frame(self.manifest.compression, buf, raw_size, self._decompressor)
        except (zstandard.ZstdError, ValueError) as exc:
            if from_cache:  # a damaged cache entry: drop it and read the frame from the stream
                self.cache.drop(self.manifest.shard_names[shard], f)
                fresh = self.fetch_frames(shard, f, f + 1, index, use_cache=False)[0]
                return self._decode(shard, f, fresh, index)
            records = (int(index.frames["first_record"][f]), index.record_stop(f))
            raise ShardCorruptError(
                f"{self.where(shard, f, records)}: frame does not decode ({exc})"
            ) from exc
        if not checked:
            check_frame_records(index, f, raw, self.dtype.itemsize, self.where(shard))
        self.counters["bytes_needed"] += int(index.frames["comp_size"][f])
        self.counters["frames_decoded"] += 1
        return raw

    def _hash(self, shard: int, f: int, buf, index: ShardIndex) -> str | None:
        """Feed frame ``f`` to the shard's running sha256; a mismatch message once it is whole."""
        if f == 0:
            self._hashes[shard] = (0, hashlib.sha256())
        state = self._hashes.get(shard)
        offset = int(index.frames["comp_offset"][f])
        if state is None or state[0] != offset:
            self._hashes.pop(shard, None)  # not read in order from frame 0: not checked
            return None
        h = state[1]
        h.update(buf)
        self._hashes[shard] = (offset + len(buf), h)
        if f < index.num_frames - 1:
            return None
        h.update(self._index_blobs.get(shard, b""))
        del self._hashes[shard]
        expected = self.manifest.shard_sha256[shard]
        if h.hexdigest() == expected:
            self.counters["shards_sha256_verified"] += 1
            return None
        return f"sha256 {h.hexdigest()[:16]}..., manifest {expected[:16]}..."

    def _skip(self, shard: int, start: int, stop: int, frame: int | None, reason: str) -> None:
        if stop <= start:
            return
        name = self.manifest.shard_names[shard]
        last = self.skipped[-1] if self.skipped else None
        if last and (last["shard"], last["frame"], last["reason"], last["stop"]) == (name, frame, reason, start):
            last["stop"] = stop
        else:
            self.skipped.append(
                {"shard": name, "shard_idx": shard, "start": start, "stop": stop, "frame": frame,
                 "reason": reason}
            )
            log.warning("skipping %s: %s", self.where(shard, frame, (start, stop)), reason)
        self.counters["skipped_records"] += stop - start

    def _skip_shard(self, shard: int, start: int, stop: int, reason: str) -> DocBatch:
        """Mark ``shard`` damaged for the rest of the pass and leave ``start..stop-1`` out."""
        self._bad_shards[shard] = reason
        self._skip(shard, start, stop, None, reason)
        return DocBatch.empty(self.dtype)

    # -- reading records ----------------------------------------------------------------------
    def read(self, shard: int, start: int, stop: int) -> DocBatch:
        """Records ``start..stop-1`` of ``shard`` as one ``DocBatch``.

        With ``on_error="skip"`` damaged records are left out (``batch.record`` names the
        ones returned) and listed in ``self.skipped``.
        """
        if stop <= start:
            return DocBatch.empty(self.dtype)
        skip = self.config.on_error == "skip"
        if shard in self._bad_shards:  # found damaged earlier in this pass (skip mode)
            return self._skip_shard(shard, start, stop, self._bad_shards[shard])
        try:
            index = self.index(shard)
        except ShardCorruptError as exc:
            if not skip:
                raise
            return self._skip_shard(shard, start, stop, str(exc))
        if start < 0 or stop > index.num_records:
            raise IndexError(f"{self.where(shard)}: records {start}..{stop} outside 0..{index.num_records}")
        first = int(index.frame_of_record(start))
        end = int(index.frame_of_record(stop - 1)) + 1
        try:
            got = self._obtain(shard, first, end, start, index)
        except ShardCorruptError as exc:  # truncated shard found while fetching
            if not skip:
                raise
            return self._skip_shard(shard, start, stop, str(exc))
        except StorageError as exc:
            exc.add_note(f"while reading {self.where(shard, (first, end), (start, stop))}")
            raise
        raws = self._decode_frames(shard, first, got, index, start, stop)
        if raws is None:
            return DocBatch.empty(self.dtype)
        if raws[-1] is not None:
            self._last = (shard, end - 1, raws[-1])
        return self._assemble(shard, index, raws, first, start, stop)

    def _decode_frames(
        self, shard: int, first: int, got: list, index: ShardIndex, start: int, stop: int
    ) -> list | None:
        """Decoded frames ``first..`` for the records ``start..stop-1`` being read; a frame that
        does not decode is None (skip mode). None for all of them when the shard fails its
        sha256 check in skip mode: the shard is then skipped."""
        skip = self.config.on_error == "skip"
        raws: list = []
        for f, item in zip(range(first, first + len(got)), got):
            if item is None:
                raws.append(self._last[2])
                continue
            try:
                raws.append(self._decode(shard, f, item, index))
            except ShardCorruptError as exc:
                if not skip:
                    raise
                self._hashes.pop(shard, None)
                lo = max(start, int(index.frames["first_record"][f]))
                self._skip(shard, lo, min(stop, index.record_stop(f)), f, str(exc))
                raws.append(None)
                continue
            if self.config.verify == "sha256":
                mismatch = self._hash(shard, f, item[0], index)
                if mismatch is not None:
                    if not skip:
                        raise ShardCorruptError(f"{self.where(shard, None, (start, stop))}: {mismatch}")
                    self._skip_shard(shard, start, stop, mismatch)
                    return None
        return raws

    def _assemble(
        self, shard: int, index: ShardIndex, raws: list, first: int, start: int, stop: int
    ) -> DocBatch:
        """The batch of records ``start..stop-1`` from their decoded frames, leaving out the
        records of frames that were skipped (None)."""
        if all(r is not None for r in raws):
            return gather(index, raws, first, shard, start, stop, self.dtype)
        parts = []
        kept = [f for f, r in zip(range(first, first + len(raws)), raws) if r is not None]
        for f0, f1 in _runs(kept):
            lo = max(start, int(index.frames["first_record"][f0]))
            hi = min(stop, index.record_stop(f1 - 1))
            parts.append(gather(index, raws[f0 - first : f1 - first], f0, shard, lo, hi, self.dtype))
        return DocBatch.concat(parts, self.dtype)

    def read_frames(self, shard: int, first: int, stop: int) -> list[bytes]:
        """Decompressed bytes of frames ``first..stop-1`` of ``shard`` (checked, never skipped)."""
        index = self.index(shard)
        got = self.fetch_frames(shard, first, stop, index)
        return [self._decode(shard, f, item, index) for f, item in zip(range(first, stop), got)]

    def read_meta(self, shard: int, record: int) -> bytes | None:
        index = self.index(shard)
        row = index.records[record]
        if int(row["meta_size"]) == 0:
            return None
        frame = int(index.frame_of_record(record))
        raw = self.read_frames(shard, frame, frame + 1)[0]
        off = int(row["meta_offset"])
        return raw[off : off + int(row["meta_size"])]

    # -- counters -------------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        """Plain numbers: requests, bytes, read amplification, retries, hedges, skips, cache, prefetch."""
        c = self.counters
        prefetcher = self._readahead.prefetcher
        out: dict[str, int | float] = {
            "requests": self.fetcher.stats.requests,
            "bytes_fetched": self.fetcher.stats.bytes_fetched,
            "obstore_requests": self.fetcher.stats.obstore_requests,
            "http_requests": self.fetcher.stats.http_requests,
            "retries": self.fetcher.retries,
            "hedged": self.fetcher.hedged,
            "hedge_won": self.fetcher.hedge_won,
            **c,
            "skipped_ranges": len(self.skipped),
            "cache_hits": self.cache.hits if self.cache else 0,
            "cache_misses": self.cache.misses if self.cache else 0,
            "cache_corrupt": self.cache.corrupt if self.cache else 0,
            "cache_evicted": self.cache.evicted if self.cache else 0,
            "prefetch_waits": prefetcher.waits if prefetcher else 0,
            "prefetch_wait_s": prefetcher.wait_seconds if prefetcher else 0.0,
            "fetch_busy_s": prefetcher.busy_seconds if prefetcher else 0.0,
        }
        needed = c["bytes_needed"]
        out["read_amplification"] = out["bytes_fetched"] / needed if needed else 0.0
        return out


_COUNTERS = (
    "bytes_needed",
    "frames_decoded",
    "index_requests",
    "prefetch_hits",
    "skipped_records",
    "shards_sha256_verified",
)


def _runs(frames: list[int]) -> Iterator[tuple[int, int]]:
    """Maximal runs of consecutive integers as ``[first, stop)`` pairs."""
    i = 0
    while i < len(frames):
        j = i
        while j + 1 < len(frames) and frames[j + 1] == frames[j] + 1:
            j += 1
        yield frames[i], frames[j] + 1
        i = j + 1
