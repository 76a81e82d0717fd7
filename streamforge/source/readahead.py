"""The reader's announced plan of record ranges, and the ``Prefetcher`` fetching it ahead.

``ShardSource.plan_reads`` hands over the ``(shard, start, stop)`` ranges it will read, in
order. ``ReadAhead`` turns them into fetch units (consecutive frames up to ``request_bytes``;
a frame shared by two neighbouring ranges is planned once), fetches and decodes them on the
prefetch threads, and gives each frame back to the read that asks for it, matched by its
position in the plan. A fresh plan from an object store reads its first shard's first bytes
beside that shard's index (``_read_head``), so its first units need no request of their own.
"""

from __future__ import annotations

import bisect
import os
import threading
from concurrent.futures import Future
from typing import Any, Iterable, Iterator, Protocol

import zstandard

from ..format.frames import ShardIndex, decode_frame
from ..errors import ShardCorruptError
from ..format.reader import check_frame_records
from ..storage.fetch import cut_frames
from ..storage.pool import DaemonPool
from ..storage.prefetch import FIRST_UNIT_BYTES, FetchUnit, Prefetcher, group_frames, ramp



class FrameSource(Protocol):
    """What the read-ahead needs of the source it reads for (``ShardSource``)."""

    manifest: Any
    dtype: Any
    fetcher: Any
    config: Any
    cache: Any
    read_share: float

    def index(self, shard: int) -> ShardIndex: ...
    def has_index(self, shard: int) -> bool: ...
    def early_head(self, shard: int) -> tuple[int, Future, int, int | None] | None: ...
    def where(self, shard: int, frame: Any = None, records: Any = None) -> str: ...
    def fetch_frames(self, shard: int, first: int, stop: int, index: ShardIndex, use_cache: bool = True) -> Any: ...


INDEXES_AHEAD = 64
INDEX_THREADS = 4  # threads reading indexes (and a fresh plan's head) ahead, from an object store
INDEX_THREADS_LOCAL = 1  # ... from local files
HEAD_BYTES = 3 * FIRST_UNIT_BYTES  # a fresh start's first two units (``ramp``), read beside the index
UNITS_IN_BUDGET = 4  # a fetch unit holds at most this fraction of the read-ahead budget
_NEAR = 8  # planned ranges from the cursor on where a read looks first (``_plan_pos``)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the read that needs it raises it, with its context
        pass


class ReadAhead:
    """Plan and prefetch for one ``FrameSource`` (a ``ShardSource``); created afresh in each reading process.

    Args:
        source: the frames' source: its record indexes and its ranged frame reads.
    """

    def __init__(self, source: FrameSource) -> None:
        self.source = source
        self.prefetcher: Prefetcher | None = None
        self._plan: list[tuple[int, int, int]] = []
        self._plan_by_shard: dict[int, list[int]] | None = None
        self._plan_cursor = 0
        self._thread_local = threading.local()
        self._index_pool: DaemonPool | None = None
        self._ready: dict[tuple[int, int], tuple] = {}  # (shard, frame) -> fetched item (fetch_now)
        # (shard, the read of its first bytes): set by ``plan``, dropped by the fetch thread
        # that finds it of no use; a stale drop only costs the round trip it would have saved
        self._head: tuple[int, Future] | None = None
        self._head_end = 0  # bytes the head read asks for: the first units end there (``_units``)
        self._head_records: int | None = None  # the first read's records an early head is sized for

    def plan(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        """Replace the plan with ``ranges``; start fetching them unless prefetch is off."""
        self._plan = [(int(s), int(a), int(b)) for s, a, b in ranges]
        self._plan_by_shard = None  # built by the first read not found near the cursor
        self._plan_cursor = 0
        self._ready.clear()
        self._head, self._head_records = None, None
        budget, threads = self.budget()
        if budget <= 0:
            self._head_now(self._plan)
            return
        self._read_head(self._plan)
        self._indexes_ahead(self._plan)
        if self.prefetcher is None:
            self.prefetcher = Prefetcher(self._fetch_unit, budget, threads, held=_held_bytes,
                                         help_reader=self.source.fetcher.local)
        self.prefetcher.plan(self._units(list(self._plan), ramp_up=True))

    def budget(self) -> tuple[int, int]:
        """(bytes, threads) of read-ahead: the config's, or its defaults for where the stream
        lives, for the stream's share of its pipeline (``StorageConfig.stream_read_ahead``)."""
        return self.source.config.stream_read_ahead(self.source.fetcher.local, self.source.read_share)

    def extend(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        """Append ``ranges`` (read after every planned one) without dropping what is
        fetched: an infinite stream's next pass is planned before this one ends."""
        first = len(self._plan)
        added = [(int(s), int(a), int(b)) for s, a, b in ranges]
        self._plan.extend(added)
        if self._plan_by_shard is not None:
            self._index_plan(first)
        if self.prefetcher is not None:
            self._indexes_ahead(added)
            self.prefetcher.extend(self._units(added, first))

    def fetch_now(self, ranges: list[tuple[int, int, int]], threads: int) -> None:
        """Fetch and decode the frames of ``ranges`` at once, on ``threads`` threads (this one
        among them), all joined before returning, for the reads that follow. For a reader
        without read-ahead that is about to read several ranges in a row (a restored window's
        first batch, built while no thread may be left running): zstd and the storage
        requests release the GIL, so the frames decode side by side instead of one after
        another. A range that fails is left for its read to fetch again and raise, with its
        context; what no read takes is dropped at the next plan."""
        units = []
        for s, a, b in ranges:
            index = self.source.index(s)
            units.append(FetchUnit(0, s, int(index.frame_of_record(a)), int(index.frame_of_record(b - 1)) + 1, 0))
        ready = self._ready
        lock = threading.Lock()
        todo = iter(units)

        def work() -> None:
            while True:
                with lock:
                    unit = next(todo, None)
                if unit is None:
                    return
                try:
                    got = self._fetch_unit(unit)
                except Exception:  # noqa: BLE001 - the read of this range raises it
                    continue
                for f, item in zip(range(unit.first, unit.stop), got):
                    ready[(unit.shard, f)] = item

        helpers = [threading.Thread(target=work, name=f"sf-fetch-now-{i}", daemon=True)
                   for i in range(min(threads, len(units)) - 1)]
        for t in helpers:
            t.start()
        work()
        for t in helpers:
            t.join()

    def close(self) -> None:
        self._ready.clear()
        self._head = None
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        if self._index_pool is not None:
            self._index_pool.close()
            self._index_pool = None

    def _indexes_ahead(self, ranges: list[tuple[int, int, int]]) -> None:
        """Read the record indexes of the first ``INDEXES_AHEAD`` shards of ``ranges`` in the
        background, outside the byte budget (an index is small): a shuffle window lays out
        its documents from their lengths before it reads a token, and would otherwise wait
        on each new shard's index in turn. A failure is left for the reader to raise.

        Where the reader's first read lies in the first shard, within the records an early
        head read is sized for (``EarlyReads.start``), they go out once that head is in: the
        first read needs none of them, and beside the head they would only share its server,
        its connections and this process's CPU."""
        source = self.source
        shards: dict[int, None] = {}  # the first ones only: a plan may hold every shard of the stream
        for s, a, b in ranges:
            if b > a and not source.has_index(s):
                shards[s] = None
                if len(shards) == INDEXES_AHEAD:
                    break
        if not shards:
            return
        pool = self._pool()
        first = next(((s, b - a) for s, a, b in ranges if b > a), None)  # (shard, records)
        head, records = self._head, self._head_records
        within = head is not None and records is not None and first is not None and first[0] == head[0]
        if within and first[1] >= records:
            later = [s for s in shards if s != head[0]]
            head[1].add_done_callback(lambda _: [pool.submit(_quietly, source.index, s) for s in later])
            return
        for shard in shards:
            pool.submit(_quietly, source.index, shard)

    def _head_target(self, plan: list[tuple[int, int, int]]) -> tuple | None:
        """``(shard, stop, name, what, size)`` of the head read worth making for ``plan``: its
        first shard's first ``stop`` bytes, where that shard is remote, read from its first
        record, its index not read yet and its first frame not cached (``head_stop``); else
        None. A head read started early for this shard (``EarlyReads.start``) is taken
        instead, as ``(shard, its Future, stop, records)``, whether or not the index is in
        already."""
        source = self.source
        first = next(((s, a) for s, a, b in plan if b > a), None)
        if first is None or first[1] != 0:
            return None
        shard = first[0]
        early = source.early_head(shard)  # (shard, its Future, stop, records)
        if early is not None:
            return early
        if source.has_index(shard):
            return None
        stop = head_stop(source, shard)
        if stop is None:
            return None
        return shard, stop, source.manifest.shard_names[shard], *head_request(source, shard, stop)[1:]

    def _read_head(self, plan: list[tuple[int, int, int]]) -> None:
        """Start reading the first ``HEAD_BYTES`` of the plan's first shard beside its index
        (``_head_target`` says when), or take the read started early for it.

        A fresh start's first batch otherwise waits for two round trips in a row: the index,
        then the frames it locates. A shard's first frame starts at byte 0, so the head holds
        the new plan's first units (``ramp``: 256 KiB, then 512 KiB) unless its frames are
        larger; the units inside it take their frames from it (``_take_head``), and it is
        dropped at the first unit of its shard that does not fit."""
        target = self._head_target(plan)
        if target is None:
            return
        if isinstance(target[1], Future):  # started early (EarlyReads.start)
            self._head, self._head_end, self._head_records = target[:2], target[2], target[3]
            return
        shard, stop, name, what, size = target
        read = self.source.fetcher.read
        self._head = (shard, self._pool().submit(lambda: read(name, 0, stop, what=what, file_size=size)))
        self._head_end = stop

    def _head_now(self, plan: list[tuple[int, int, int]]) -> None:
        """The same two reads side by side without read-ahead (a head start's pipeline, which
        must leave no thread running): the index on a thread joined before returning, the
        head on this one; the frames of the plan's first range that the head holds whole are
        decoded at once for the reads that follow (``take``). Any failure is left to the
        reads, which make their own requests and raise with their context."""
        target = self._head_target(plan)
        if target is None:
            return
        source = self.source
        if isinstance(target[1], Future):  # started early (EarlyReads.start): wait for both
            shard = target[0]
            _quietly(source.index, shard)
            try:
                blob = target[1].result()
            except Exception:  # noqa: BLE001 - the first read makes its own request, and raises
                blob = None
        else:
            shard, stop, name, what, size = target
            indexing = threading.Thread(target=_quietly, args=(source.index, shard), name="sf-head-index",
                                        daemon=True)
            indexing.start()
            try:
                blob = source.fetcher.read(name, 0, stop, what=what, file_size=size)
            except Exception:  # noqa: BLE001 - the first read makes its own request, and raises
                blob = None
            indexing.join()
        if blob is None or not source.has_index(shard):
            return
        index = source.index(shard)
        _, a, b = next(r for r in plan if r[2] > r[1])
        first = int(index.frame_of_record(a))
        last = int(index.frame_of_record(min(b, index.num_records) - 1)) + 1
        ends = index.frames["comp_offset"][first:last] + index.frames["comp_size"][first:last]
        whole = first + int((ends <= len(blob)).sum())  # the frames wholly inside the head
        if whole == first:
            return
        done: Future = Future()
        done.set_result(blob)
        self._head = (shard, done)
        try:
            items = self._fetch_unit(FetchUnit(0, shard, first, whole, 0))
        finally:
            self._head = None
        for f, item in zip(range(first, whole), items):
            self._ready[(shard, f)] = item

    def _take_head(self, unit: FetchUnit, index: ShardIndex) -> list | None:
        """The frames of ``unit`` from the head read (``_read_head``); None where the unit is
        of another shard, where it ends past the head (the head is then dropped), or where the
        head's read failed (the unit's own request retries, and raises with its context)."""
        head = self._head
        if head is None or head[0] != unit.shard:
            return None
        _, hi = index.byte_range(unit.first, unit.stop)
        try:
            blob = head[1].result()
        except Exception:  # noqa: BLE001 - the unit's own request raises it with context
            blob = None
        if blob is None or hi > len(blob):
            self._head = None
            return None
        frames, source = index.frames, self.source
        return cut_frames(blob, 0, frames["comp_offset"], frames["comp_size"], unit.first, unit.stop,
                          source.cache, source.manifest.shard_names[unit.shard])

    def _pool(self) -> DaemonPool:
        if self._index_pool is None:
            # remote: the head read and three index reads side by side (a short first shard's
            # window goes on into the next shard, whose index must not wait behind the head).
            # Local: no head read, and an index read is a pread of microseconds, so one thread
            # keeps ahead of the reader; each more thread costs its own malloc arena, where
            # the indexes it read live (about 1 MiB of resident memory a thread)
            threads = INDEX_THREADS_LOCAL if self.source.fetcher.local else INDEX_THREADS
            self._index_pool = DaemonPool(threads, "sf-index")
        return self._index_pool

    def take(self, shard: int, start: int, frames: list[int], index: ShardIndex) -> list:
        """The prefetched ``(buffer, from_cache, raw)`` of each of ``frames`` (in order) of a read
        of ``shard`` from record ``start``; None for a frame not prefetched."""
        if self._ready:
            return [self._ready.pop((shard, f), None) for f in frames]
        pf = self.prefetcher
        j = self._plan_pos(shard, start) if pf is not None else None
        if j is None:
            return [None] * len(frames)
        positions = []
        for f in frames:
            rec = max(start, int(index.frames["first_record"][f]))
            while (j + 1 < len(self._plan) and self._plan[j][2] <= rec
                   and self._plan[j + 1][0] == shard):
                j += 1
            positions.append((j, f))
        until = positions[-1] if positions else None  # a waiting reader helps up to here
        return [pf.take((shard, f), pos, until) for f, pos in zip(frames, positions)]

    def _units(self, plan: list[tuple[int, int, int]], first_idx: int = 0, ramp_up: bool = False) -> Iterator[FetchUnit]:
        """Fetch units of ``plan``; a new plan's (``ramp_up``) start small and double (``ramp``),
        an extension's are full size at once. A unit holds at most a quarter of the budget
        (compressed plus decoded): the scheduler starts a unit only while the bytes held
        leave room for it, or when nothing is held, so a unit as large as the budget is
        fetched only once the reader has taken every frame before it, and the read-ahead
        never runs ahead of the reader."""
        budget = self.budget()[0]
        cap = max(1, self.source.config.request_bytes)
        held_cap = max(1, budget // UNITS_IN_BUDGET)
        caps = ramp(cap) if ramp_up else cap
        head = self._head[0] if ramp_up and self._head is not None else None
        last = None
        for i, (shard, start, stop) in enumerate(plan, first_idx):
            if stop <= start:
                continue
            try:
                index = self.source.index(shard)
            except Exception:  # noqa: BLE001 - the read of this range raises it with context
                continue
            stop = min(stop, index.num_records)
            if start >= stop:
                continue
            first = int(index.frame_of_record(start))
            end = int(index.frame_of_record(stop - 1)) + 1
            if last == (shard, first):
                first += 1  # planned already as the previous range's last frame
            frames = index.frames
            if shard == head and first == 0:  # the units inside the head end where it ends
                ends = frames["comp_offset"][:end] + frames["comp_size"][:end]
                inside = int((ends <= self._head_end).sum())
                if 0 < inside < end:
                    yield from group_frames(i, shard, 0, inside, frames["comp_size"], frames["raw_size"], caps,
                                            held_cap)
                    first = inside
                head = None
            yield from group_frames(i, shard, first, end, frames["comp_size"], frames["raw_size"], caps, held_cap)
            last = (shard, end - 1)

    def _fetch_unit(self, unit: FetchUnit) -> list:
        """Fetch a planned unit, decompress its frames and check their records' tar headers on
        the fetch thread: zstd releases the GIL, so decoding overlaps the reader's work even
        without worker processes. A frame handed over decoded is checked; one that fails to
        decode or the check here is handed over compressed and fails again, with the reader's
        error policy, in ``ShardSource._decode``."""
        source = self.source
        index = source.index(unit.shard)
        got = self._take_head(unit, index) if self._head is not None else None
        if got is None:
            got = source.fetch_frames(unit.shard, unit.first, unit.stop, index)
        local = self._thread_local
        decompressor = getattr(local, "decompressor", None)
        if decompressor is None:
            decompressor = local.decompressor = zstandard.ZstdDecompressor()
        out = []
        codec = source.manifest.compression
        # the compressed bytes are kept only where the reader still needs them (a running
        # sha256, a frame that failed here): each is a view of the whole request's buffer
        keep = source.config.verify == "sha256"
        itemsize, where = source.dtype.itemsize, source.where(unit.shard)
        for f, (buf, from_cache) in zip(range(unit.first, unit.stop), got):
            try:
                raw = decode_frame(codec, buf, int(index.frames["raw_size"][f]), decompressor)
                check_frame_records(index, f, raw, itemsize, where)
            except (zstandard.ZstdError, ValueError, ShardCorruptError):
                raw = None
            out.append((buf if keep or raw is None else None, from_cache, raw))
        return out

    def _index_plan(self, first: int) -> None:
        """Add the plan's ranges from ``first`` on to its index by shard."""
        for i, (s, _, _) in enumerate(self._plan[first:], first):
            self._plan_by_shard.setdefault(s, []).append(i)

    def _plan_pos(self, shard: int, start: int) -> int | None:
        """Index of the planned range holding record ``start`` of ``shard`` (searching forward).
        Reads follow the plan, so it is found within a few ranges of the cursor; the plan's
        ranges of each shard are indexed only for a read that is not, since indexing a plan
        of a range a shard costs a pass over every range (docs/design.md, "A manifest of many
        shards")."""
        plan = self._plan
        for j in range(self._plan_cursor, min(self._plan_cursor + _NEAR, len(plan))):
            s, a, b = plan[j]
            if s == shard and a <= start < b:
                self._plan_cursor = j
                return j
        if self._plan_by_shard is None:
            self._plan_by_shard = {}
            self._index_plan(0)
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


def head_stop(source: FrameSource, shard: int, records: int | None = None) -> int | None:
    """How many of shard ``shard``'s first bytes a head read asks for (``HEAD_BYTES``, at most
    the shard's frames), or None where none is worth making: a local shard, a shard without
    frames, or one whose first frame the cache holds.

    With ``records``, the reader's first read holds the shard's first that many records (a
    pass's first shuffle window): the head asks for about their bytes, estimated from the
    manifest (the shard's mean compressed bytes a record, a quarter more, and a mean frame for
    the frame the last of them ends in), up to ``HEAD_BYTES``, so that the first read waits
    for the transfer and decoding of no more than it needs; the units after the head fetch
    the rest. A head found short only costs the first read a request of its own."""
    if source.fetcher.local:
        return None
    col = source.manifest.columns
    data = int(col["index_offset"][shard])
    stop = min(HEAD_BYTES, data)
    n = int(col["num_records"][shard])
    if records is not None and 0 < records < n and "num_frames" in col:
        frame = data / max(1, int(col["num_frames"][shard]))
        stop = min(stop, int(1.25 * data * records / n + frame) + 1)
    name = source.manifest.shard_names[shard]
    if stop <= 0 or (source.cache is not None and os.path.exists(source.cache.path(name, 0))):
        return None  # the cache holds the first frame: no request to save
    return stop


def head_request(source: FrameSource, shard: int, stop: int) -> tuple[str, str, int]:
    """``(name, what, file size)`` of the read of shard ``shard``'s first ``stop`` bytes."""
    return (source.manifest.shard_names[shard], f"{source.where(shard)} bytes 0..{stop}",
            int(source.manifest.columns["bytes"][shard]))


def _held_bytes(item) -> int:
    """Bytes a fetched frame keeps: its decoded bytes, and its compressed ones where kept."""
    buf, _, raw = item
    return (len(raw) if raw is not None else 0) + (len(buf) if buf is not None else 0)
