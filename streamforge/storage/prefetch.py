"""Background fetching of the frames a reader will decode next, within a byte budget.

The reader hands over its plan: the ordered frame requests it will make (``FetchUnit``s,
consecutive frames of one shard grouped up to ``request_bytes``). A scheduler thread walks
the plan and queues units for ``threads`` fetch threads while the bytes in flight plus the
bytes fetched but not yet taken stay within ``budget``; a unit larger than the budget is
still fetched when nothing else is held, so progress never stalls. The reader ``take``s
frames in plan order; a frame it never asks for is released once the reader has taken a
later one. A new plan replaces the old one at once (results of the old plan are dropped).
With ``help_reader`` (local files), a reader waiting for a frame in flight fetches the next
queued unit on its own thread meanwhile.

Failures in the background are not retried twice: the fetch function already retries, and
its final error is handed to the reader when it takes the frame, so it surfaces in the
reader's thread with the reader's context.

Memory held per reader: at most ``budget`` plus one unit's bytes.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from .pool import serve

Key = tuple[int, int]  # (shard, frame)
Pos = tuple[int, int]  # (index of the planned range, frame): the reader's order
_END: Pos = (1 << 62, 0)


FIRST_UNIT_BYTES = 256 << 10  # compressed bytes of a new plan's first unit (``ramp``)


@dataclass(frozen=True)
class FetchUnit:
    """Frames ``first..stop-1`` of ``shard``, planned range ``range_idx``: one request."""

    range_idx: int
    shard: int
    first: int
    stop: int
    nbytes: int


class _Entry:
    __slots__ = ("pos", "nbytes", "data", "error", "done")

    def __init__(self, pos: Pos, nbytes: int) -> None:
        self.pos = pos
        self.nbytes = nbytes
        self.data = None
        self.error: BaseException | None = None
        self.done = False


class Prefetcher:
    """Fetches planned units ahead of the reader; one per reader, started lazily."""

    def __init__(
        self, fetch: Callable[[FetchUnit], list], budget: int, threads: int,
        held: Callable[[Any], int] | None = None, help_reader: bool = False,
    ) -> None:
        self._fetch = fetch  # unit -> list of per-frame buffers, in frame order
        # a reader waiting for a frame in flight fetches the next queued unit itself (``take``)
        self.help_reader = help_reader
        # bytes a fetched buffer holds: once a unit is fetched, its frames count what they
        # hold instead of the unit's estimate (a frame kept decoded only counts its raw bytes)
        self._held_by = held
        self.budget = budget
        self.threads = threads
        self._cond = threading.Condition()
        self._entries: dict[Key, _Entry] = {}
        self._held = 0
        self._generation = 0
        self._reader_pos: Pos = (-1, 0)
        self._progress: Pos = _END  # every frame before this position is registered
        self._plan: Iterator[FetchUnit] | None = None
        # units registered and not begun, in plan order; each has a wake-up on ``_queue`` for
        # a fetch thread, and a waiting reader may take one first (``take``)
        self._jobs: deque = deque()
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._workers: list[threading.Thread] = []
        self._scheduler: threading.Thread | None = None
        self.hits = 0
        self.waits = 0  # takes that found the scheduler behind the reader
        self.wait_seconds = 0.0  # the reader's time in take() waiting for frames, for any reason
        self.busy_seconds = 0.0  # the fetch threads' time in fetch (summed over threads)

    @property
    def held_bytes(self) -> int:
        return self._held

    # -- reader side ----------------------------------------------------------------------
    def plan(self, units: Iterable[FetchUnit]) -> None:
        """Replace the plan; ``units`` may be lazy (it is consumed by the scheduler thread)."""
        with self._cond:
            self._generation += 1
            self._entries.clear()
            self._jobs.clear()  # the old plan's units not begun are not fetched at all
            self._held = 0
            self._reader_pos = (-1, 0)
            self._progress = (-1, 0)
            self._plan = iter(units)
            self._cond.notify_all()
        self._start()

    def extend(self, units: Iterable[FetchUnit]) -> None:
        """Append ``units`` to the plan, keeping what is fetched or in flight (``units`` come
        after every planned one in the reader's order)."""
        units = iter(units)
        with self._cond:
            if self._closed:
                return
            if self._plan is None:  # the plan ran out: the new units start a fresh tail
                self._plan = units
                self._progress = min(self._progress, self._reader_pos)
            else:
                self._plan = itertools.chain(self._plan, units)
            self._cond.notify_all()
        self._start()

    def take(self, key: Key, pos: Pos, until: Pos | None = None):
        """The buffer of frame ``key`` if the plan has it at or before ``pos``, else None.

        Waits for the scheduler to reach ``pos`` and for the fetch to finish; raises the
        error the background fetch ended with. ``until``: the last position of the read this
        frame is part of (default ``pos``); with ``help_reader``, a wait fetches the units
        queued up to there on this thread.
        """
        with self._cond:
            if pos > self._reader_pos:
                self._reader_pos = pos
                self._drop_passed()
            generation = self._generation
            began = None
            if key not in self._entries and self._progress <= pos:
                self.waits += 1  # the reader is ahead of the scheduler
                began = time.perf_counter()
                while (
                    key not in self._entries
                    and self._progress <= pos
                    and generation == self._generation
                    and not self._closed
                ):
                    self._cond.wait()
            entry = self._entries.get(key)
            if entry is not None and not entry.done:
                if began is None:
                    began = time.perf_counter()
                while not entry.done and self._entries.get(key) is entry:
                    job = self._queued(pos if until is None else until) if self.help_reader else None
                    if job is None:
                        self._cond.wait()
                        continue
                    self._cond.release()
                    try:
                        self._complete(*job)
                    finally:
                        self._cond.acquire()
            if began is not None:  # a wait for the scheduler, a fetch in flight, or both
                self.wait_seconds += time.perf_counter() - began
            if entry is None:
                return None
            if self._entries.get(key) is not entry:
                return None  # the plan was replaced while waiting
            del self._entries[key]
            data, error = entry.data, entry.error
            self._release(entry)
            self._cond.notify_all()
            if error is not None:
                raise error
            self.hits += 1
            return data

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._generation += 1
            self._entries.clear()
            self._jobs.clear()
            self._held = 0
            self._cond.notify_all()
        for _ in self._workers:
            self._queue.put(None)

    # -- internals (call with the lock held) ----------------------------------------------
    def _queued(self, until: Pos):
        """The first queued unit not begun, taken off the queue, where the reader's read needs
        it (it starts at or before ``until``); else None.

        A reader of local files waits for frames only where the decoding fell behind it (a
        shuffle window wants thousands of documents at once); the frames it waits for are
        in flight on a fetch thread, and the queued units after them are what its read needs
        next. Decoding one on the reader's thread puts both cores to work on the wait (zstd
        releases the GIL). A unit past the read stays for the fetch threads: decoding it here
        would hold the reader back for frames it does not need yet. A reader of an object
        store does not help: it would wait on a request instead of on the frame it asked for."""
        jobs = self._jobs
        if jobs and (jobs[0][1].range_idx, jobs[0][1].first) <= until:
            return jobs.popleft()
        return None

    def _release(self, entry: _Entry) -> None:
        """Give back an entry's share of the budget and drop its buffers: an entry may still
        be named by a fetch thread's last unit, which must not keep the bytes alive."""
        self._held -= entry.nbytes
        entry.nbytes = 0
        entry.data = entry.error = None

    def _drop_passed(self) -> None:
        """Release fetched frames the reader has moved past. Entries are kept in plan order
        (``_register``), so the scan stops at the first one still ahead: a call costs the
        frames it drops (plus the few still in flight), not every frame held."""
        stale = []
        for k, e in self._entries.items():
            if e.pos >= self._reader_pos:
                break
            if e.done:
                stale.append(k)
        for k in stale:
            self._release(self._entries.pop(k))
        if stale:
            self._cond.notify_all()

    # -- background -----------------------------------------------------------------------
    def _start(self) -> None:
        if self._scheduler is not None:
            return
        self._scheduler = threading.Thread(target=self._schedule, name="sf-prefetch", daemon=True)
        self._scheduler.start()
        for i in range(self.threads):
            t = threading.Thread(target=self._work, name=f"sf-fetch-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def _schedule(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._plan is None:
                    self._cond.wait()
                if self._closed:
                    return
                generation, plan = self._generation, self._plan
            try:
                unit = next(plan, None)
            except Exception:  # noqa: BLE001 - the reader fetches and raises on its own
                unit = None
            with self._cond:
                if generation != self._generation:
                    continue
                if unit is None:
                    if self._plan is not plan:  # extended meanwhile: go on with the tail
                        continue
                    self._plan = None
                    self._progress = _END
                    self._cond.notify_all()
                    continue
                self._progress = max(self._progress, (unit.range_idx, unit.first))
                self._cond.notify_all()
                while (
                    not self._closed
                    and generation == self._generation
                    and (self._held > 0 and self._held + unit.nbytes > self.budget or self._collides(unit))
                ):
                    self._cond.wait()
                if self._closed or generation != self._generation:
                    continue
                keys, entries = self._register(unit)
                self._progress = max(self._progress, (unit.range_idx, unit.stop))
                if keys:
                    self._jobs.append((generation, unit, keys, entries))
                self._cond.notify_all()
            if keys:
                self._queue.put(())  # a fetch thread's wake-up: it takes the first job left

    def _collides(self, unit: FetchUnit) -> bool:
        """A frame of ``unit`` is held for an earlier position (an infinite stream's next pass
        reads the same frames again): the unit waits until the reader took or passed it."""
        entries = self._entries
        return any((unit.shard, f) in entries for f in range(unit.first, unit.stop))

    def _register(self, unit: FetchUnit) -> tuple[list[Key], list[_Entry]]:
        count = unit.stop - unit.first
        share = unit.nbytes // count
        keys, entries = [], []
        for i, frame in enumerate(range(unit.first, unit.stop)):
            nbytes = share if i < count - 1 else unit.nbytes - share * (count - 1)
            entry = _Entry((unit.range_idx, frame), nbytes)
            key = (unit.shard, frame)
            old = self._entries.pop(key, None)  # re-inserted at the end: entries stay in plan order
            if old is not None:
                self._release(old)
            self._entries[key] = entry
            keys.append(key)
            entries.append(entry)
        self._held += unit.nbytes
        return keys, entries

    def _work(self) -> None:
        serve(self._queue, self._next_job)

    def _next_job(self) -> None:
        """Fetch the first queued unit, unless a waiting reader took every one already."""
        with self._cond:
            job = self._jobs.popleft() if self._jobs else None
        if job is not None:
            self._complete(*job)

    def _complete(self, generation: int, unit: FetchUnit, keys: list[Key], entries: list[_Entry]) -> None:
        with self._cond:
            if generation != self._generation:
                return
        began = time.perf_counter()
        try:
            buffers, error = self._fetch(unit), None
        except BaseException as exc:  # noqa: BLE001 - handed to the reader in take()
            buffers, error = [None] * len(keys), exc
        with self._cond:
            self.busy_seconds += time.perf_counter() - began
            for k, e, buf in zip(keys, entries, buffers):
                e.done = True
                if generation != self._generation or self._entries.get(k) is not e:
                    continue  # replaced or released meanwhile: the bytes are not kept
                e.data, e.error = buf, error
                if e.pos < self._reader_pos:
                    self._release(self._entries.pop(k))
                elif self._held_by is not None and error is None:
                    held = self._held_by(buf)
                    self._held += held - e.nbytes
                    e.nbytes = held
            self._cond.notify_all()


def group_frames(
    range_idx: int, shard: int, first: int, stop: int, comp_sizes, raw_sizes, cap: int | Iterator[int],
    held_cap: int | None = None,
) -> Iterator[FetchUnit]:
    """Frames ``first..stop-1`` of ``shard`` as units of consecutive frames, each at most
    ``cap`` compressed bytes and, with ``held_cap``, at most that many compressed plus decoded
    bytes (a larger frame is a unit alone); ``cap`` may be an iterator, one cap per unit
    (``ramp``). A unit is held compressed and decoded, so its ``nbytes`` counts both against
    the budget."""
    caps = itertools.repeat(cap) if isinstance(cap, int) else cap
    limit = held_cap if held_cap is not None else 1 << 62
    f = first
    while f < stop:
        cap = next(caps)
        g, comp, total = f, 0, 0
        while g < stop:
            c, r = int(comp_sizes[g]), int(raw_sizes[g])
            if g > f and (comp + c > cap or total + c + r > limit):
                break
            comp, total = comp + c, total + c + r
            g += 1
        yield FetchUnit(range_idx, shard, f, g, total)
        f = g


def ramp(cap: int, first: int = FIRST_UNIT_BYTES) -> Iterator[int]:
    """Caps for the units of a new plan: ``first``, twice that, ... up to ``cap``, then
    ``cap``. A reader starting or resuming waits for its first unit whole (fetched, then
    decoded); a full-size first unit (8 MiB from an object store) would hold the first
    batch back by the transfer and decode of frames it does not need yet."""
    size = max(1, min(first, cap))
    while size < cap:
        yield size
        size *= 2
    yield from itertools.repeat(cap)
