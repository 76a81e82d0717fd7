"""``read_records``: the records of one shard by URL, fetching only what they need."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..format.frames import RECORD_DTYPE, decode_frame_table, frame_table_bytes
from ..format.reader import decode_frame_run, records_of_rows
from .shard_source import ShardSource


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
    raws = decode_frame_run(
        source.manifest.compression, frames, blob, first, last, lambda f: source.where(shard, f)
    )
    yield from records_of_rows(
        frames, raws, rows, start, source.dtype, lambda f, r: source.where(shard, f, (r, r + 1))
    )
