"""Decoding records from shard bytes: frames in, documents out as one flat token array.

Everything here is a function of bytes already in memory (the shard index, decoded frames,
rows of the record table); fetching them is ``streamforge/source.py``'s job. Decoded records
come back in bulk as one flat token array plus offsets (``DocBatch``): per-document Python
objects would dominate the cost.
"""

from __future__ import annotations

import sys
from typing import Iterator

import numpy as np
import zstandard

from ..errors import ShardCorruptError
from .checks import check_index  # noqa: F401 - read by streamforge/source, which imports it from here
from .frames import ShardIndex, decode_frame
from ..pipeline import core
from .tar import member_mismatch, npy_header_size_fixed


class Spans:
    """Where each document of a ``DocBatch`` lies in the decoded frames it was read from: document
    i is ``length[i]`` tokens from byte ``start[i]`` of ``frames[frame[i]]``. A window laid out
    from spans copies its documents straight from the frames (``Window``, the compiled core's
    ``fill_window``) without one Python object per document."""

    __slots__ = ("frames", "frame", "start", "length")

    def __init__(self, frames: list, frame: np.ndarray, start: np.ndarray, length: np.ndarray) -> None:
        self.frames = frames  # decoded frames (bytes)
        self.frame = frame  # int64: each document's frame, an index into ``frames``
        self.start = start  # int64: its first byte in that frame
        self.length = length  # int64: its tokens

    def take(self, which: np.ndarray) -> Spans:
        """The spans of documents ``which`` (an index array), in that order."""
        return Spans(self.frames, self.frame[which], self.start[which], self.length[which])

    def views(self, dtype: np.dtype) -> list[np.ndarray]:
        """One view per document into its frame, in ``dtype``, no token copied. Where every
        document starts at a multiple of the token size in its frame (the writer's layout),
        each is one slice of its frame seen as tokens; otherwise a slice of its bytes, then
        seen as tokens."""
        itemsize = dtype.itemsize
        # per-document numbers as lists: a numpy operation over thousands of documents lets go
        # of the GIL, and the read-ahead thread may then hold it for a switch interval
        frame_of, byte_offsets, counts = self.frame.tolist(), self.start.tolist(), self.length.tolist()
        if itemsize == 1 or not any(a % itemsize for a in byte_offsets):
            frame_views = [np.frombuffer(f, dtype, len(f) // itemsize) for f in self.frames]
            return [frame_views[fr][a // itemsize : a // itemsize + n] for fr, a, n in zip(frame_of, byte_offsets, counts)]
        frame_views = [np.frombuffer(f, np.uint8) for f in self.frames]
        return [frame_views[fr][a : a + n * itemsize].view(dtype) for fr, a, n in zip(frame_of, byte_offsets, counts)]

    def token(self, i: int, offset: int, dtype: np.dtype) -> int:
        """Token ``offset`` of document ``i``."""
        frame, at = self.frames[self.frame[i]], int(self.start[i]) + offset * dtype.itemsize
        if dtype.kind == "u":  # a few bytes: cheaper than a numpy view
            native = dtype.byteorder in "=|"
            order = sys.byteorder if native else ("big" if dtype.byteorder == ">" else "little")
            return int.from_bytes(frame[at : at + dtype.itemsize], order)
        return int(np.frombuffer(frame, dtype, 1, at)[0])

    @staticmethod
    def concat(spans: list[Spans]) -> Spans:
        bases = np.cumsum([0] + [len(s.frames) for s in spans[:-1]])
        return Spans([f for s in spans for f in s.frames],
                      np.concatenate([s.frame + b for s, b in zip(spans, bases.tolist())]),
                      np.concatenate([s.start for s in spans]), np.concatenate([s.length for s in spans]))


class DocBatch:
    """Documents as one flat token array: document i is ``tokens[offsets[i]:offsets[i+1]]``.

    A batch read from shards instead holds ``spans``: where each document lies in the decoded
    frames, so a consumer that reorders documents (the shuffle) copies each token once.
    ``views`` (one view per document into the frames, in the token dtype) and ``tokens`` are
    then built on first use.
    """

    __slots__ = ("_tokens", "_views", "spans", "dtype", "offsets", "shard", "record")

    def __init__(self, tokens, offsets, shard, record, *, views=None, spans: Spans | None = None, dtype=None) -> None:
        self._tokens = tokens
        self._views = views
        self.spans = spans
        self.dtype = np.dtype(dtype) if dtype is not None else tokens.dtype
        self.offsets = offsets
        self.shard = shard
        self.record = record

    @property
    def views(self) -> list[np.ndarray] | None:
        if self._views is None and self.spans is not None:
            self._views = self.spans.views(self.dtype)
        return self._views

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            views = self.views
            self._tokens = np.concatenate(views) if views else np.zeros(0, self.dtype)
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
        if all(b.spans is not None for b in batches):
            spans = Spans.concat([b.spans for b in batches])
            return DocBatch(None, offsets, shard, record, spans=spans, dtype=dtype)
        if all(b.views is not None for b in batches):
            views = [v for b in batches for v in b.views]
            return DocBatch(None, offsets, shard, record, views=views, dtype=dtype)
        tokens = np.concatenate([b.tokens for b in batches])
        return DocBatch(tokens, offsets, shard, record)

    @staticmethod
    def empty(dtype: np.dtype) -> DocBatch:
        z = np.zeros(0, np.int64)
        return DocBatch(np.zeros(0, dtype), np.zeros(1, np.int64), z, z.copy())


def check_frame_records(index: ShardIndex, frame: int, raw, itemsize: int, where: str) -> None:
    """Raise ``ShardCorruptError`` unless the tar header of every record of ``frame`` (its
    decoded bytes ``raw``) gives the member the size the index does: a record longer or
    shorter than its index says would otherwise be cut short, or padded with the next
    member's bytes, without a word. Once per decoded frame: one call into the compiled core
    where it is built, else vectorized with numpy (the same answer)."""
    lo, hi = int(index.first_records[frame]), index.record_stop(frame)
    if hi <= lo:
        return
    rows = index.records[lo:hi]
    found = None
    head = npy_header_size_fixed(itemsize)
    if core.ext is not None and head is not None:  # the same check in one loop (pipeline/_core.c)
        found = core.ext.member_check(raw, rows["token_offset"], rows["num_tokens"], rows["meta_offset"],
                                      rows["meta_size"], head, itemsize)
    if found is None:
        found = member_mismatch(np.frombuffer(raw, np.uint8), rows, itemsize)
    elif found == -1:
        return
    bad, kind, expected, said = found
    if bad >= 0:
        raise ShardCorruptError(f"{where} frame {frame} record {lo + bad}: {member_problem(kind, expected, said)}")


def member_problem(kind: str, expected: int, said: int | None) -> str:
    """What is wrong with a record's tar member (``tar.member_mismatch``)."""
    what = "no tar header" if said is None else f"a tar header of {said} bytes"
    return (f"its .{kind} member has {what} where the index puts one of {expected} bytes "
            "(the record is not the length its index says)")


def gather(
    index: ShardIndex, frames: list[bytes], first_frame: int, shard: int, start: int, stop: int,
    dtype: np.dtype,
) -> DocBatch:
    """Records ``start..stop-1`` of ``shard`` in its decoded frames ``first_frame..``: where
    each one lies (``Spans``), no token copied and no object made per record (``views``, one
    numpy view per record in ``dtype``, are made on first use)."""
    records = index.records[start:stop]
    lengths = records["num_tokens"].astype(np.int64)
    frame_of = index.frame_of_record(np.arange(start, stop)) - first_frame
    spans = Spans(list(frames), frame_of.astype(np.int64, copy=False), records["token_offset"].astype(np.int64), lengths)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return DocBatch(
        None, offsets, np.full(len(lengths), shard, np.int64),
        np.arange(start, stop, dtype=np.int64), spans=spans, dtype=dtype,
    )


def decode_frame_run(
    codec: str, frames: np.ndarray, blob, first: int, last: int, where_frame
) -> dict[int, bytes]:
    """Decode frames ``first..last`` of a shard from ``blob``, their compressed bytes end to end
    (``frames`` is the shard's frame table). ``where_frame(f)`` names frame ``f`` in errors."""
    begin = int(frames["comp_offset"][first])
    decompressor = zstandard.ZstdDecompressor()
    raws = {}
    for f in range(first, last + 1):
        a = int(frames["comp_offset"][f]) - begin
        try:
            raws[f] = decode_frame(codec, blob[a : a + int(frames["comp_size"][f])],
                                   int(frames["raw_size"][f]), decompressor)
        except (zstandard.ZstdError, ValueError) as exc:
            raise ShardCorruptError(f"{where_frame(f)}: frame does not decode ({exc})") from exc
    return raws


def records_of_rows(
    frames: np.ndarray, raws: dict[int, bytes], rows: np.ndarray, start: int, dtype: np.dtype,
    where_record,
) -> Iterator[np.ndarray]:
    """Token arrays (copies) of records ``start, start+1, ...`` from their rows of the record
    table and their decoded frames. ``where_record(f, r)`` names record ``r`` in errors."""
    itemsize = dtype.itemsize
    for r, row in zip(range(start, start + len(rows)), rows):
        f = int(np.searchsorted(frames["first_record"], r, side="right")) - 1
        off, n = int(row["token_offset"]), int(row["num_tokens"])
        if off + n * itemsize > len(raws[f]):
            raise ShardCorruptError(f"{where_record(f, r)}: record lies outside its frame")
        bad, kind, expected, said = member_mismatch(np.frombuffer(raws[f], np.uint8), rows[r - start : r - start + 1], itemsize)
        if bad >= 0:
            raise ShardCorruptError(f"{where_record(f, r)}: {member_problem(kind, expected, said)}")
        yield np.frombuffer(raws[f], dtype, n, off).copy()
