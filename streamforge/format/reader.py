"""Reading shards by frame: the index with one ranged request, records with one more.

``ShardSource`` is the random-access view of one stream. Reading record ``r`` fetches the
shard index (once, cached) and the compressed bytes of the frames holding the wanted
records, never the bytes before them. Decoded records come back in bulk as one flat token
array plus offsets (``DocBatch``): per-document Python objects would dominate the cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import zstandard

from ..errors import ShardCorruptError
from ..storage.fetch import ByteFetcher
from .frames import ShardIndex, decode_index
from .manifest import Manifest


@dataclass
class DocBatch:
    """Documents as one flat token array: document i is ``tokens[offsets[i]:offsets[i+1]]``."""

    tokens: np.ndarray
    offsets: np.ndarray  # int64, len n + 1
    shard: np.ndarray  # int64 per document
    record: np.ndarray  # int64 per document (index within its shard)

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
        sizes = np.cumsum([0] + [len(b.tokens) for b in batches[:-1]])
        offsets = [batches[0].offsets[:1]] + [b.offsets[1:] + s for b, s in zip(batches, sizes)]
        return DocBatch(
            tokens=np.concatenate([b.tokens for b in batches]),
            offsets=np.concatenate(offsets),
            shard=np.concatenate([b.shard for b in batches]),
            record=np.concatenate([b.record for b in batches]),
        )

    @staticmethod
    def empty(dtype: np.dtype) -> DocBatch:
        z = np.zeros(0, np.int64)
        return DocBatch(np.zeros(0, dtype), np.zeros(1, np.int64), z, z.copy())


class ShardSource:
    """Random access to the records of one stream."""

    def __init__(
        self,
        manifest: Manifest,
        fetcher: ByteFetcher,
        *,
        verify_sizes: bool = True,
    ) -> None:
        self.manifest = manifest
        self.fetcher = fetcher
        self.dtype = manifest.token_np_dtype()
        self.verify_sizes = verify_sizes
        self._indexes: dict[int, ShardIndex] = {}
        self._decompressor = zstandard.ZstdDecompressor()

    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any] | None = None, **kwargs: Any) -> ShardSource:
        manifest = Manifest.load(url, storage_options)
        return cls(manifest, ByteFetcher(url, storage_options), **kwargs)

    def where(self, shard: int) -> str:
        return f"{self.fetcher.url}/{self.manifest.shard_names[shard]}"

    def index(self, shard: int) -> ShardIndex:
        cached = self._indexes.get(shard)
        if cached is not None:
            return cached
        info = self.manifest.columns
        start = int(info["index_offset"][shard])
        stop = start + int(info["index_bytes"][shard])
        name = self.manifest.shard_names[shard]
        blob = self.fetcher.read(name, start, stop)
        index = decode_index(blob, self.where(shard))
        expected = int(info["num_records"][shard])
        if index.num_records != expected:
            raise ShardCorruptError(
                f"{self.where(shard)}: index lists {index.num_records} records, manifest {expected}"
            )
        self._indexes[shard] = index
        return index

    def read_frames(self, shard: int, first: int, stop: int) -> list[bytes]:
        """Decompressed bytes of frames ``first..stop-1`` of ``shard``, fetched in one request."""
        index = self.index(shard)
        lo, hi = index.byte_range(first, stop)
        name = self.manifest.shard_names[shard]
        blob = memoryview(self.fetcher.read(name, lo, hi))
        out = []
        for f in range(first, stop):
            start = int(index.frames["comp_offset"][f]) - lo
            comp = blob[start : start + int(index.frames["comp_size"][f])]
            raw_size = int(index.frames["raw_size"][f])
            try:
                raw = self._decompressor.decompress(comp, max_output_size=raw_size)
            except zstandard.ZstdError as exc:
                raise ShardCorruptError(f"{self.where(shard)}: frame {f} does not decode: {exc}") from exc
            if len(raw) != raw_size:
                raise ShardCorruptError(
                    f"{self.where(shard)}: frame {f} decodes to {len(raw)} bytes, index says {raw_size}"
                )
            out.append(raw)
        return out

    def read(self, shard: int, start: int, stop: int) -> DocBatch:
        """Records ``start..stop-1`` of ``shard`` as one ``DocBatch``."""
        if stop <= start:
            return DocBatch.empty(self.dtype)
        index = self.index(shard)
        if start < 0 or stop > index.num_records:
            raise IndexError(f"{self.where(shard)}: records {start}..{stop} outside 0..{index.num_records}")
        first_frame = int(index.frame_of_record(start))
        stop_frame = int(index.frame_of_record(stop - 1)) + 1
        frames = self.read_frames(shard, first_frame, stop_frame)
        return self._gather(shard, index, frames, first_frame, start, stop)

    def _gather(
        self, shard: int, index: ShardIndex, frames: list[bytes], first_frame: int, start: int, stop: int
    ) -> DocBatch:
        records = index.records[start:stop]
        lengths = records["num_tokens"].astype(np.int64)
        itemsize = self.dtype.itemsize
        frame_of = index.frame_of_record(np.arange(start, stop)) - first_frame
        pieces = []
        views = [np.frombuffer(f, np.uint8) for f in frames]
        for fr, off, n in zip(frame_of.tolist(), records["token_offset"].tolist(), lengths.tolist()):
            pieces.append(views[fr][off : off + n * itemsize])
        flat = np.concatenate(pieces).view(self.dtype) if pieces else np.zeros(0, self.dtype)
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return DocBatch(
            tokens=flat,
            offsets=offsets,
            shard=np.full(len(lengths), shard, np.int64),
            record=np.arange(start, stop, dtype=np.int64),
        )

    def read_meta(self, shard: int, record: int) -> bytes | None:
        index = self.index(shard)
        row = index.records[record]
        if int(row["meta_size"]) == 0:
            return None
        frame = int(index.frame_of_record(record))
        raw = self.read_frames(shard, frame, frame + 1)[0]
        off = int(row["meta_offset"])
        return raw[off : off + int(row["meta_size"])]


def read_records(
    url: str,
    shard: int,
    start: int = 0,
    stop: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[np.ndarray]:
    """Yield the token arrays of records ``start..stop-1`` of one shard of the stream at ``url``.

    Only the shard index and the frames holding those records are fetched.
    """
    source = ShardSource.open(url, storage_options)
    if not 0 <= shard < source.manifest.num_shards:
        raise IndexError(f"{url}: shard {shard} outside 0..{source.manifest.num_shards - 1}")
    num_records = int(source.manifest.columns["num_records"][shard])
    stop = num_records if stop is None else min(stop, num_records)
    # Read a frame-sized stretch at a time so memory stays bounded for whole-shard reads.
    index = source.index(shard) if stop > start else None
    record = start
    while record < stop:
        frame = int(index.frame_of_record(record))
        chunk_stop = min(stop, index.record_stop(frame))
        batch = source.read(shard, record, chunk_stop)
        for i in range(len(batch)):
            yield batch.doc(i).copy()
        record = chunk_stop
