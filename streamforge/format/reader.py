"""Reading shards by frame: the index with one ranged request, records with one more.

``ShardSource`` is the random-access view of one stream. Reading record ``r`` fetches the
shard index (once, cached) and the compressed bytes of the frames holding the wanted
records, never the bytes before them. Decoded records come back in bulk as one flat token
array plus offsets (``DocBatch``): per-document Python objects would dominate the cost.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
from typing import Any, Iterable, Iterator

import numpy as np
import zstandard

from ..errors import ShardCorruptError, StorageError
from ..storage.cache import FrameCache
from ..storage.config import StorageConfig
from ..storage.fetch import ByteFetcher
from ..storage.prefetch import FetchUnit, Prefetcher
from .frames import RECORD_DTYPE, ShardIndex, decode_frame, decode_frame_table, decode_index, frame_table_bytes
from .manifest import Manifest

log = logging.getLogger("streamforge.storage")


class DocBatch:
    """Documents as one flat token array: document i is ``tokens[offsets[i]:offsets[i+1]]``.

    A batch read from shards may instead hold ``views``: one byte view per document into the
    decoded frames, so a consumer that reorders documents (the shuffle) copies each token
    once; ``tokens`` is then built on first use.
    """

    __slots__ = ("_tokens", "views", "dtype", "offsets", "shard", "record")

    def __init__(self, tokens, offsets, shard, record, *, views=None, dtype=None) -> None:
        self._tokens = tokens
        self.views = views
        self.dtype = np.dtype(dtype) if dtype is not None else tokens.dtype
        self.offsets = offsets
        self.shard = shard
        self.record = record

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            joined = np.concatenate(self.views) if self.views else np.zeros(0, np.uint8)
            self._tokens = joined.view(self.dtype)
        return self._tokens

    def __len__(self) -> int:
        return len(self.record)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @staticmethod
    def concat(batches: list[DocBatch], dtype: np.dtype) -> DocBatch:
        batches = [b for b in batches if len(b)]
        if not batches:
            return DocBatch.empty(dtype)
        if len(batches) == 1:
            return batches[0]
        sizes = np.cumsum([0] + [int(b.offsets[-1]) for b in batches[:-1]])
        offsets = np.concatenate(
            [batches[0].offsets[:1]] + [b.offsets[1:] + s for b, s in zip(batches, sizes)]
        )
        shard = np.concatenate([b.shard for b in batches])
        record = np.concatenate([b.record for b in batches])
        if all(b.views is not None for b in batches):
            views = [v for b in batches for v in b.views]
            return DocBatch(None, offsets, shard, record, views=views, dtype=dtype)
        tokens = np.concatenate([b.tokens for b in batches])
        return DocBatch(tokens, offsets, shard, record)

    @staticmethod
    def empty(dtype: np.dtype) -> DocBatch:
        z = np.zeros(0, np.int64)
        return DocBatch(np.zeros(0, dtype), np.zeros(1, np.int64), z, z.copy())


class ShardSource:
    """Random access to the records of one stream, with prefetch, cache and integrity checks.

    Picklable before and after use: threads, the prefetch buffer and filesystem handles are
    created lazily in the process that reads.
    """

    def __init__(
        self, manifest: Manifest, fetcher: ByteFetcher, *, config: StorageConfig | None = None
    ) -> None:
        self.manifest = manifest
        self.fetcher = fetcher
        self.config = config or StorageConfig()
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
        self._thread_local = threading.local()
        self._prefetcher: Prefetcher | None = None
        self._plan: list[tuple[int, int, int]] = []
        self._plan_by_shard: dict[int, list[int]] = {}
        self._plan_cursor = 0
        self._last: tuple[int, int, bytes] | None = None  # last decoded (shard, frame, raw)
        self._hashes: dict[int, tuple[int, Any]] = {}  # shard -> (next offset, sha256 state)
        self._bad_shards: dict[int, str] = {}
        self.skipped: list[dict[str, Any]] = []
        self.counters = dict.fromkeys(_COUNTERS, 0)

    def __getstate__(self) -> dict:
        keep = ("manifest", "fetcher", "config", "dtype", "cache")
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
        manifest = Manifest.load(url, storage_options, retry=config.retry)
        return cls(manifest, ByteFetcher(url, storage_options, config.retry), config=config)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

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
    def index(self, shard: int) -> ShardIndex:
        cached = self._indexes.get(shard)
        if cached is not None:
            return cached
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
        frames = index.frames
        ends = frames["comp_offset"].astype(np.int64) + frames["comp_size"]
        problems = [
            (index.num_records, int(col["num_records"][shard]), "records"),
            (index.num_frames, int(col["num_frames"][shard]), "frames"),
            (index.num_tokens, int(col["num_tokens"][shard]), "tokens"),
            (int(ends[-1]) if len(ends) else 0, start, "bytes of frames"),
        ]
        for found, expected, what in problems:
            if found != expected:
                raise ShardCorruptError(f"{where}: index lists {found} {what}, manifest {expected}")
        if len(frames) and (frames["comp_offset"][0] != 0 or np.any(frames["comp_offset"][1:] != ends[:-1])):
            raise ShardCorruptError(f"{where}: index frames are not contiguous")
        if self.config.verify == "sha256":
            self._index_blobs[shard] = blob
        return index

    # -- planning and prefetch ----------------------------------------------------------------
    def plan_reads(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        """Announce the ``(shard, start_record, stop_record)`` ranges about to be read, in order.

        Their frames are fetched in the background, at most ``prefetch_bytes`` ahead of the
        reads. A new call replaces the plan. Reads outside the plan still work.
        """
        self._plan = [(int(s), int(a), int(b)) for s, a, b in ranges]
        self._plan_by_shard = {}
        for i, (s, _, _) in enumerate(self._plan):
            self._plan_by_shard.setdefault(s, []).append(i)
        self._plan_cursor = 0
        if self.config.prefetch_bytes <= 0:
            return
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(
                self._fetch_unit, self.config.prefetch_bytes, self.config.prefetch_threads
            )
        self._prefetcher.plan(self._units(list(self._plan)))

    def _units(self, plan: list[tuple[int, int, int]]) -> Iterator[FetchUnit]:
        cap = max(1, min(self.config.request_bytes, self.config.prefetch_bytes // 2))
        last = None
        for i, (shard, start, stop) in enumerate(plan):
            if stop <= start:
                continue
            try:
                index = self.index(shard)
            except Exception:  # noqa: BLE001 - the read of this range raises it with context
                continue
            stop = min(stop, index.num_records)
            if start >= stop:
                continue
            first = int(index.frame_of_record(start))
            end = int(index.frame_of_record(stop - 1)) + 1
            if last == (shard, first):
                first += 1  # planned already as the previous range's last frame
            sizes = index.frames["comp_size"]
            raw_sizes = index.frames["raw_size"]
            f = first
            while f < end:
                g, nbytes = f, 0
                while g < end and (g == f or nbytes + int(sizes[g]) <= cap):
                    nbytes += int(sizes[g])
                    g += 1
                # a unit is held compressed and decoded: both count against the budget
                yield FetchUnit(i, shard, f, g, nbytes + int(raw_sizes[f:g].sum()))
                f = g
            last = (shard, end - 1)

    def _fetch_unit(self, unit: FetchUnit) -> list:
        """Fetch a planned unit and decompress its frames on the fetch thread: zstd releases
        the GIL, so decoding overlaps the reader's work even without worker processes. A frame
        that fails to decode here is handed over compressed and fails again, with the reader's
        error policy, in ``_decode``."""
        index = self.index(unit.shard)
        got = self._fetch_frames(unit.shard, unit.first, unit.stop, index)
        local = self._thread_local
        decompressor = getattr(local, "decompressor", None)
        if decompressor is None:
            decompressor = local.decompressor = zstandard.ZstdDecompressor()
        out = []
        codec = self.manifest.compression
        for f, (buf, from_cache) in zip(range(unit.first, unit.stop), got):
            try:
                raw = decode_frame(codec, buf, int(index.frames["raw_size"][f]), decompressor)
            except (zstandard.ZstdError, ValueError):
                raw = None
            out.append((buf, from_cache, raw))
        return out

    def _plan_pos(self, shard: int, start: int) -> int | None:
        """Index of the planned range holding record ``start`` of ``shard`` (searching forward)."""
        idxs = self._plan_by_shard.get(shard)
        if not idxs:
            return None
        k = bisect.bisect_left(idxs, self._plan_cursor)
        for j in idxs[k:] + idxs[:k]:
            _, a, b = self._plan[j]
            if a <= start < b:
                self._plan_cursor = j
                return j
        return None

    # -- fetching frames ----------------------------------------------------------------------
    def _fetch_frames(self, shard: int, first: int, stop: int, index: ShardIndex, use_cache=True):
        """Compressed bytes of frames ``first..stop-1``: from the cache, else one request per run
        of missing frames. Returns ``[(buffer, from_cache), ...]``."""
        name = self.manifest.shard_names[shard]
        offsets, sizes = index.frames["comp_offset"], index.frames["comp_size"]
        out: list = [None] * (stop - first)
        if self.cache is not None and use_cache:
            for f in range(first, stop):
                data = self.cache.get(name, f, int(sizes[f]))
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
            records = (int(index.frames["first_record"][f]), index.record_stop(g - 1))
            blob = memoryview(self.fetcher.read(
                name, lo, hi, what=self.where(shard, (f, g), records),
                file_size=int(self.manifest.columns["bytes"][shard]),
            ))
            for h in range(f, g):
                a = int(offsets[h]) - lo
                piece = blob[a : a + int(sizes[h])]
                out[h - first] = (piece, False)
                if self.cache is not None:
                    self.cache.put(name, h, piece)
            f = g
        return out

    def _obtain(self, shard: int, first: int, stop: int, start: int, index: ShardIndex) -> list:
        """``[(buffer, from_cache) or None (decoded already), ...]`` for frames first..stop-1."""
        out: list = [None] * (stop - first)
        pf = self._prefetcher
        j = self._plan_pos(shard, start) if pf is not None else None
        missing = []
        for f in range(first, stop):
            if self._last is not None and self._last[0] == shard and self._last[1] == f:
                continue
            buf = None
            if j is not None:
                rec = max(start, int(index.frames["first_record"][f]))
                while (j + 1 < len(self._plan) and self._plan[j][2] <= rec
                       and self._plan[j + 1][0] == shard):
                    j += 1
                buf = pf.take((shard, f), (j, f))
            if buf is None:
                missing.append(f)
            else:
                out[f - first] = buf
                self.counters["prefetch_hits"] += 1
        for f0, f1 in _runs(missing):
            out[f0 - first : f1 - first] = self._fetch_frames(shard, f0, f1, index)
        return out

    # -- decoding and checks ------------------------------------------------------------------
    def _decode(self, shard: int, f: int, got, index: ShardIndex) -> bytes:
        if self._decompressor is None:
            self._decompressor = zstandard.ZstdDecompressor()
        buf, from_cache = got[0], got[1]
        raw_size = int(index.frames["raw_size"][f])
        try:
            raw = got[2] if len(got) > 2 and got[2] is not None else None
            if raw is None:
                raw = decode_frame(self.manifest.compression, buf, raw_size, self._decompressor)
        except (zstandard.ZstdError, ValueError) as exc:
            if from_cache:  # a damaged cache entry: drop it and read the frame from the stream
                self.cache.drop(self.manifest.shard_names[shard], f)
                fresh = self._fetch_frames(shard, f, f + 1, index, use_cache=False)[0]
                return self._decode(shard, f, fresh, index)
            records = (int(index.frames["first_record"][f]), index.record_stop(f))
            raise ShardCorruptError(
                f"{self.where(shard, f, records)}: frame does not decode ({exc})"
            ) from exc
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
            self._skip(shard, start, stop, None, self._bad_shards[shard])
            return DocBatch.empty(self.dtype)
        try:
            index = self.index(shard)
        except ShardCorruptError as exc:
            if not skip:
                raise
            self._bad_shards[shard] = str(exc)
            self._skip(shard, start, stop, None, str(exc))
            return DocBatch.empty(self.dtype)
        if start < 0 or stop > index.num_records:
            raise IndexError(f"{self.where(shard)}: records {start}..{stop} outside 0..{index.num_records}")
        first = int(index.frame_of_record(start))
        end = int(index.frame_of_record(stop - 1)) + 1
        try:
            got = self._obtain(shard, first, end, start, index)
        except ShardCorruptError as exc:  # truncated shard found while fetching
            if not skip:
                raise
            self._bad_shards[shard] = str(exc)
            self._skip(shard, start, stop, None, str(exc))
            return DocBatch.empty(self.dtype)
        except StorageError as exc:
            exc.add_note(f"while reading {self.where(shard, (first, end), (start, stop))}")
            raise
        raws: list = []
        for f, item in zip(range(first, end), got):
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
                    self._bad_shards[shard] = mismatch
                    self._skip(shard, start, stop, None, mismatch)
                    return DocBatch.empty(self.dtype)
        if raws[-1] is not None:
            self._last = (shard, end - 1, raws[-1])
        if all(r is not None for r in raws):
            return self._gather(shard, index, raws, first, start, stop)
        parts = []
        for f0, f1 in _runs([f for f, r in zip(range(first, end), raws) if r is not None]):
            lo = max(start, int(index.frames["first_record"][f0]))
            hi = min(stop, index.record_stop(f1 - 1))
            parts.append(self._gather(shard, index, raws[f0 - first : f1 - first], f0, lo, hi))
        return DocBatch.concat(parts, self.dtype)

    def _gather(
        self, shard: int, index: ShardIndex, frames: list[bytes], first_frame: int, start: int, stop: int
    ) -> DocBatch:
        records = index.records[start:stop]
        lengths = records["num_tokens"].astype(np.int64)
        itemsize = self.dtype.itemsize
        frame_of = index.frame_of_record(np.arange(start, stop)) - first_frame
        frame_views = [np.frombuffer(f, np.uint8) for f in frames]
        byte_offsets = records["token_offset"].tolist()
        byte_stops = (records["token_offset"] + lengths * itemsize).tolist()
        views = [frame_views[fr][a:b] for fr, a, b in zip(frame_of.tolist(), byte_offsets, byte_stops)]
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return DocBatch(
            None, offsets, np.full(len(lengths), shard, np.int64),
            np.arange(start, stop, dtype=np.int64), views=views, dtype=self.dtype,
        )

    def read_frames(self, shard: int, first: int, stop: int) -> list[bytes]:
        """Decompressed bytes of frames ``first..stop-1`` of ``shard`` (checked, never skipped)."""
        index = self.index(shard)
        got = self._fetch_frames(shard, first, stop, index)
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
        """Plain numbers: requests, bytes, read amplification, retries, skips, cache, prefetch."""
        c = self.counters
        out: dict[str, int | float] = {
            "requests": self.fetcher.stats.requests,
            "bytes_fetched": self.fetcher.stats.bytes_fetched,
            "retries": self.fetcher.retries,
            **c,
            "skipped_ranges": len(self.skipped),
            "cache_hits": self.cache.hits if self.cache else 0,
            "cache_misses": self.cache.misses if self.cache else 0,
            "cache_corrupt": self.cache.corrupt if self.cache else 0,
            "cache_evicted": self.cache.evicted if self.cache else 0,
            "prefetch_waits": self._prefetcher.waits if self._prefetcher else 0,
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

def read_records(
    url: str,
    shard: int,
    start: int = 0,
    stop: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[np.ndarray]:
    """Yield the token arrays of records ``start..stop-1`` of one shard of the stream at ``url``.

    Only what those records need is fetched: for a few records, the shard's frame table, their
    rows of the record table and their frames (three small ranged reads, about one frame of
    bytes); for longer ranges, the whole shard index, then the frames a stretch at a time.
    """
    source = ShardSource.open(url, storage_options)
    if not 0 <= shard < source.manifest.num_shards:
        raise IndexError(f"{url}: shard {shard} outside 0..{source.manifest.num_shards - 1}")
    num_records = int(source.manifest.columns["num_records"][shard])
    stop = num_records if stop is None else min(stop, num_records)
    if stop <= start:
        return
    if start < 0:
        raise IndexError(f"{url}: record {start} is negative")
    index_bytes = int(source.manifest.columns["index_bytes"][shard])
    if (stop - start) * RECORD_DTYPE.itemsize * 8 < index_bytes:
        yield from _read_few(source, shard, start, stop)
        return
    # Read a frame-sized stretch at a time so memory stays bounded for whole-shard reads.
    index = source.index(shard)
    record = start
    while record < stop:
        frame = int(index.frame_of_record(record))
        chunk_stop = min(stop, index.record_stop(frame))
        batch = source.read(shard, record, chunk_stop)
        for i in range(len(batch)):
            yield batch.doc(i).copy()
        record = chunk_stop


def _read_few(source: ShardSource, shard: int, start: int, stop: int) -> Iterator[np.ndarray]:
    """A few records with three ranged reads: frame table, their record rows, their frames."""
    col = source.manifest.columns
    name = source.manifest.shard_names[shard]
    where = source.where(shard)
    base = int(col["index_offset"][shard])
    table_end = frame_table_bytes(int(col["num_frames"][shard]))
    size = int(col["bytes"][shard])
    frames = decode_frame_table(
        source.fetcher.read(name, base, base + table_end, what=f"{where} frame table", file_size=size), where
    )
    lo = base + table_end + start * RECORD_DTYPE.itemsize
    rows = np.frombuffer(
        source.fetcher.read(name, lo, lo + (stop - start) * RECORD_DTYPE.itemsize,
                            what=f"{where} record table", file_size=size),
        RECORD_DTYPE,
    )
    first = int(np.searchsorted(frames["first_record"], start, side="right")) - 1
    last = int(np.searchsorted(frames["first_record"], stop - 1, side="right")) - 1
    begin = int(frames["comp_offset"][first])
    end = int(frames["comp_offset"][last]) + int(frames["comp_size"][last])
    blob = memoryview(source.fetcher.read(name, begin, end, what=source.where(shard, (first, last + 1)), file_size=size))
    decompressor = zstandard.ZstdDecompressor()
    raws = {}
    for f in range(first, last + 1):
        a = int(frames["comp_offset"][f]) - begin
        try:
            raws[f] = decode_frame(source.manifest.compression, blob[a : a + int(frames["comp_size"][f])],
                                   int(frames["raw_size"][f]), decompressor)
        except (zstandard.ZstdError, ValueError) as exc:
            raise ShardCorruptError(f"{source.where(shard, f)}: frame does not decode ({exc})") from exc
    itemsize = source.dtype.itemsize
    for r, row in zip(range(start, stop), rows):
        f = int(np.searchsorted(frames["first_record"], r, side="right")) - 1
        off, n = int(row["token_offset"]), int(row["num_tokens"])
        if off + n * itemsize > len(raws[f]):
            raise ShardCorruptError(f"{source.where(shard, f, (r, r + 1))}: record lies outside its frame")
        yield np.frombuffer(raws[f], source.dtype, n, off).copy()
