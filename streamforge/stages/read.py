"""ShardReader: the records of one stream assigned to one global worker, pass after pass.

State is a cursor ``{"pass", "range", "offset"}``: the next record is ``offset`` records into
range ``range`` of this worker's plan for ``pass``. Reading is in bulk (``read(n)`` returns
up to n documents as one ``DocBatch``), and a read never crosses a pass boundary, so a
caller sees where each pass ends. ``next()`` hands out one document at a time and moves on to
the next pass by itself.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, TypedDict

from ..errors import ResumeMismatchError
from ..format.manifest import Manifest
from ..format.reader import DocBatch
from ..source import ShardSource
from ..planning.plan import Range
from ..planning.token_cuts import trims
from .base import check_state
from .cut_source import cut_view

# A saved ShardReader cursor: the next record is ``offset`` records into range ``range`` of the
# worker's plan for pass ``pass`` (functional form: ``pass`` is a Python keyword).
ReaderState = TypedDict("ReaderState", {"pass": int, "range": int, "offset": int})
STATE_KEYS: tuple[str, ...] = tuple(ReaderState.__annotations__)  # the keys of a saved state


class ReaderCursor(NamedTuple):
    """A saved ``ShardReader`` cursor, read by ``ShardReader.saved_cursor``."""

    pass_idx: int
    range_idx: int
    offset: int


class ShardReader:
    """The records of one stream that the plan gives one global worker, pass after pass: the
    first stage of a worker's pipeline. Implements the stage contract (``stages.base.Stage``):
    ``next()`` is the next document as a one-record ``DocBatch``.

    Args:
        source: the stream's shards (``ShardSource``, or any object with ``manifest``,
            ``dtype``, ``read(shard, start, stop)`` and ``index(shard)``); ``plan_reads`` and
            ``extend_reads``, where it has them, are told the records coming next.
        ranges_for: pass -> this worker's record ranges ``(shard, start, stop)`` of that pass.
        stream_key: the stream's name, for messages.
        infinite: move on to the next pass when one ends (else the reader ends with its pass).
        first_pass: the pass the cursor starts in.
    """

    def __init__(
        self,
        source: ShardSource,
        *,
        ranges_for: Callable[[int], list[Range]],
        stream_key: str,
        infinite: bool,
        first_pass: int = 0,
    ) -> None:
        self.source = source
        self.manifest: Manifest = source.manifest
        self.ranges_for = ranges_for  # pass -> this worker's ranges, from the plan
        self.stream_key = stream_key
        self.infinite = infinite
        self.first_pass = first_pass
        self._set_cursor(first_pass, 0, 0)

    # -- plan ------------------------------------------------------------------------------
    def _set_cursor(self, pass_idx: int, range_idx: int, offset: int) -> None:
        if getattr(self, "pass_idx", None) != pass_idx or not hasattr(self, "ranges"):
            self.ranges = self.ranges_for(pass_idx)
            self.source = cut_view(self.source, trims(self.ranges))  # token cuts: the pieces
        self.pass_idx, self.range_idx, self.offset = pass_idx, range_idx, offset
        self._announced = False
        self._announced_through = -1  # the last pass the source's plan holds

    def _announce(self) -> None:
        """Tell the source which records come next, so it can prefetch them (done before the
        first read after the cursor moved, never on a mere restore). An infinite reader also
        announces the next pass, so read-ahead runs on across the pass boundary."""
        self._announced = True
        plan_reads = getattr(self.source, "plan_reads", None)
        if plan_reads is None:
            return
        upcoming = self.unread()
        self._announced_through = self.pass_idx
        if self.infinite and hasattr(self.source, "extend_reads"):
            upcoming += self.ranges_for(self.pass_idx + 1)
            self._announced_through = self.pass_idx + 1
        plan_reads(upcoming)

    # -- reading ---------------------------------------------------------------------------
    @property
    def pass_done(self) -> bool:
        return self.range_idx >= len(self.ranges)

    def next_pass(self) -> bool:
        """Move to the next pass if infinite; False when a finite reader is exhausted."""
        if not self.infinite:
            return False
        ahead = self._announced and self._announced_through > self.pass_idx
        self._set_cursor(self.pass_idx + 1, 0, 0)
        if ahead:  # this pass is planned already: plan the one after it, keep the prefetched
            held = self.source.extend_reads(self.ranges_for(self.pass_idx + 1))
            self._announced, self._announced_through = True, self.pass_idx + 1
            if held > 4 * max(1, len(self.ranges)) + 64:
                self._announced = False  # the plan grew long: start a fresh one at the next read
        return True

    def announce(self) -> None:
        """Hand the source the plan from the cursor on, unless it has it already: before a
        caller looks at the coming records' indexes, so they are fetched in parallel."""
        if not self._announced:
            self._announce()

    def read(self, max_records: int) -> DocBatch:
        """Up to ``max_records`` documents of the current pass (fewer at its end)."""
        self.announce()
        parts = []
        want = max_records
        while want > 0 and self.range_idx < len(self.ranges):
            shard, start, stop = self.ranges[self.range_idx]
            lo = start + self.offset
            hi = min(stop, lo + want)
            parts.append(self.source.read(shard, lo, hi))
            want -= hi - lo
            if hi == stop:
                self.range_idx, self.offset = self.range_idx + 1, 0
            else:
                self.offset = hi - start
        return DocBatch.concat(parts, self.source.dtype)

    def peek_ranges(self, max_records: int) -> list[Range]:
        """The ranges ``read(max_records)`` would read, without reading or moving."""
        out: list[Range] = []
        want, i, offset = max_records, self.range_idx, self.offset
        while want > 0 and i < len(self.ranges):
            shard, start, stop = self.ranges[i]
            lo = start + offset
            hi = min(stop, lo + want)
            out.append((shard, lo, hi))
            want -= hi - lo
            i, offset = (i + 1, 0) if hi == stop else (i, hi - start)
        return out

    def skip(self, num_records: int) -> None:
        """Move the cursor ``num_records`` forward without reading (within the pass)."""
        while num_records > 0 and self.range_idx < len(self.ranges):
            shard, start, stop = self.ranges[self.range_idx]
            step = min(num_records, stop - start - self.offset)
            num_records -= step
            if start + self.offset + step == stop:
                self.range_idx, self.offset = self.range_idx + 1, 0
            else:
                self.offset += step
        self._announced = False

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> ReaderState:
        return {"pass": self.pass_idx, "range": self.range_idx, "offset": self.offset}

    @staticmethod
    def saved_cursor(state: ReaderState) -> ReaderCursor:
        """The (pass, range, offset) of a saved state, without checking them against a plan;
        ``ResumeMismatchError`` if it lacks a key."""
        check_state(state, STATE_KEYS, "ShardReader")
        return ReaderCursor(*(int(state[k]) for k in STATE_KEYS))  # type: ignore[literal-required]

    def check_state(self, state: ReaderState) -> ReaderCursor:
        """The cursor of ``state``, or ``ResumeMismatchError`` naming what is out of range."""
        pass_idx, range_idx, offset = cursor = self.saved_cursor(state)
        where = f"ShardReader({self.stream_key})"
        if pass_idx < 0:
            raise ResumeMismatchError(f"{where}: pass {pass_idx} is negative")
        ranges = self.ranges_for(pass_idx)
        if not 0 <= range_idx <= len(ranges):
            raise ResumeMismatchError(
                f"{where}: range {range_idx} is outside this worker's {len(ranges)} ranges of pass {pass_idx}"
            )
        size = ranges[range_idx][2] - ranges[range_idx][1] if range_idx < len(ranges) else 1
        if not 0 <= offset < size:
            raise ResumeMismatchError(
                f"{where}: offset {offset} is outside range {range_idx} ({size} records) of pass {pass_idx}"
            )
        return cursor

    def load_state_dict(self, state: ReaderState) -> None:
        self._set_cursor(*self.check_state(state))

    def unread(self) -> list[Range]:
        """The ranges of the current pass from the cursor on (the reader's work left)."""
        rest = self.ranges[self.range_idx :]
        if rest and self.offset:
            shard, start, stop = rest[0]
            rest[0] = (shard, start + self.offset, stop)
        return [r for r in rest if r[2] > r[1]]

    def seek(self, pass_idx: int, records: int) -> None:
        """Put the cursor ``records`` records into this worker's ranges of ``pass_idx``."""
        self._set_cursor(pass_idx, 0, 0)
        self.skip(records)

    # -- stage contract --------------------------------------------------------------------
    def __iter__(self) -> ShardReader:
        return self

    def __next__(self) -> DocBatch:
        """The next document (a record the source skipped as damaged is passed over)."""
        while True:
            if self.pass_done and not self.next_pass():
                raise StopIteration
            docs = self.read(1)
            if len(docs):
                return docs

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
