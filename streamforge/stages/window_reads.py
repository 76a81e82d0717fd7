"""Restore I/O of a shuffle window: reading back the documents of a saved window's rest.

A restore knows the window's order from the indexes alone (``window_order``), so it lays the
rest of the window out at once and reads the frames that hold documents not yet handed on,
never the ones before. Two ways:

* ``Pending``: one read per frame, in the order in which each frame's first document leaves,
  fetched ahead in that order; the consumer reads (``read_until``) as it goes, so the first
  batch after a resume waits for the frames of its own documents only.
* ``read_records``: every pending frame read at once, in runs of consecutive frames; used
  where the source may skip damaged records, since a record left out changes the layout.
"""

from __future__ import annotations

import itertools
from typing import Callable, NamedTuple

import numpy as np

from ..errors import ShardCorruptError
from ..format.reader import DocBatch


def doc_views(docs: DocBatch) -> list[np.ndarray]:
    """One view per document of ``docs``, in its token dtype."""
    if docs.views is not None:
        return docs.views
    src = docs.tokens
    bounds = docs.offsets.tolist()
    return [src[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def locate(shards: np.ndarray, records: np.ndarray, want_shards: np.ndarray, want_records: np.ndarray):
    """For each wanted (shard, record): its index among ``(shards, records)`` and whether it is
    there at all (vectorized: one sort and one search)."""
    have = (shards.astype(np.int64) << 40) | records.astype(np.int64)
    want = (want_shards.astype(np.int64) << 40) | want_records.astype(np.int64)
    order = np.argsort(have, kind="stable")
    pos = np.minimum(np.searchsorted(have[order], want), max(len(have) - 1, 0))
    at = order[pos] if len(have) else np.zeros(len(want), np.int64)
    present = (have[at] == want) if len(have) else np.zeros(len(want), bool)
    return at, present


def frame_runs(source, shard: np.ndarray, record: np.ndarray, ranges) -> list[tuple[int, int, int]]:
    """Record ranges covering whole runs of the frames that hold the given (sorted) records,
    clipped to the window's ``ranges``: one read per run of frames, each frame decoded once."""
    out = []
    for s, a, b in ranges:
        mask = (shard == s) & (record >= a) & (record < b)
        if not mask.any():
            continue
        index = source.index(s)
        frames = np.sort(index.frame_of_record(record[mask]))
        # distinct frames without np.unique, whose first call imports numpy.ma
        frames = frames[np.concatenate(([True], frames[1:] != frames[:-1]))]
        breaks = np.flatnonzero(np.diff(frames) != 1) + 1
        for run in np.split(frames, breaks):
            lo = max(a, int(index.frames["first_record"][run[0]]))
            hi = min(b, index.record_stop(int(run[-1])))
            out.append((s, lo, hi))
    return out


def read_records(source, shard: np.ndarray, record: np.ndarray, ranges) -> DocBatch:
    """The documents (``shard``, ``record``, in the order of the window's ranges) of a window
    with ``ranges``, read as runs of whole frames (``frame_runs``), announced to the source
    first; a record the source skips as damaged is missing from the result."""
    runs = frame_runs(source, shard, record, ranges)
    plan_reads = getattr(source, "plan_reads", None)
    if plan_reads is not None:
        plan_reads(runs)  # fetch only these documents' frames
    return DocBatch.concat([source.read(s, a, b) for s, a, b in runs], source.dtype)


class FrameRead(NamedTuple):
    """One read of a restore: records ``start..stop-1`` of ``shard`` (one frame), whose pending
    documents ``records`` leave at window positions ``positions`` (ascending)."""

    shard: int
    start: int
    stop: int
    positions: list
    records: list


def restore_units(source, ranges, shard: np.ndarray, record: np.ndarray, skip: int) -> list[FrameRead]:
    """The reads of a restored window: one per frame holding pending documents, from the first
    of them to the last (the frame is decoded whole either way, but no view is made of the
    records around them), ordered by the position of its first pending document.
    ``shard``/``record`` are the pending documents in emission order, from position ``skip``."""
    units = []
    position = np.arange(skip, skip + len(shard), dtype=np.int64)
    for s, a, b in ranges:
        mask = (shard == s) & (record >= a) & (record < b)
        if not mask.any():
            continue
        index = source.index(s)
        recs, pos = record[mask], position[mask]
        frames = index.frame_of_record(recs)
        by_frame = np.argsort(frames, kind="stable")  # stable: each frame's documents stay in emission order
        frames, recs, pos = frames[by_frame], recs[by_frame], pos[by_frame]
        heads = np.flatnonzero(np.concatenate(([True], frames[1:] != frames[:-1])))
        lo = np.minimum.reduceat(recs, heads).tolist()
        hi = (np.maximum.reduceat(recs, heads) + 1).tolist()
        bounds = heads.tolist() + [len(recs)]
        recs, pos = recs.tolist(), pos.tolist()
        for i, (l, h) in enumerate(zip(lo, hi)):
            units.append(FrameRead(s, l, h, pos[bounds[i] : bounds[i + 1]], recs[bounds[i] : bounds[i + 1]]))
    units.sort(key=lambda u: u.positions[0])
    return units


_DONE = 1 << 62


class Pending:
    """A restored window's frames still to read, in the order their first documents leave.

    Args:
        source: the stream's shards (``read``, ``index``, ``where``, ``dtype``; ``plan_reads``
            and ``fetch_now`` where it has them).
        ranges: the window's record ranges.
        shard, record: the pending documents in emission order, from position ``skip``.
        skip: the documents of the window handed on before the save.
    """

    def __init__(self, source, ranges, shard: np.ndarray, record: np.ndarray, skip: int) -> None:
        self.source = source
        self.units = restore_units(source, ranges, shard, record, skip)
        plan_reads = getattr(source, "plan_reads", None)
        if plan_reads is not None:
            plan_reads([(u.shard, u.start, u.stop) for u in self.units])  # fetched in the order they are needed
        self.next = 0
        self.ready = self._first_position()  # every document before it is read

    def _first_position(self) -> int:
        return self.units[self.next].positions[0] if self.next < len(self.units) else _DONE

    @property
    def done(self) -> bool:
        return self.next == len(self.units)

    def read_until(self, stop: int, place: Callable[[int, np.ndarray], None]) -> None:
        """Read frames until every document before window position ``stop`` is read, handing
        each as ``place(position, tokens)``; the frames read here are fetched side by side."""
        source = self.source
        fetch_now = getattr(source, "fetch_now", None)
        if fetch_now is not None and self.ready < stop:
            now = itertools.takewhile(lambda u: u.positions[0] < stop, itertools.islice(self.units, self.next, None))
            fetch_now((u.shard, u.start, u.stop) for u in now)
        dtype = source.dtype
        while self.ready < stop:
            s, a, b, positions, records = self.units[self.next]
            docs = source.read(s, a, b)
            if len(docs) != b - a:
                raise ShardCorruptError(f"{source.where(s, None, (a, b))}: {len(docs)} of {b - a} records read back")
            views = doc_views(docs)
            for e, r in zip(positions, records):
                place(e, views[r - a])
            self.next += 1
            self.ready = self._first_position()
