"""A first batch's reads, started before the reader that needs them exists.

A fresh start from an object store reads, in a row: the manifest, the plan's record indexes
(the shards the cuts between workers fall in), then the first shard's index and its first
bytes (``ReadAhead``'s head read), then the first batch. The worker that builds the first
batch starts at record 0 of the pass's first shard, which the manifest alone names, so its
two reads need not wait for the plan: ``EarlyReads.start`` sends them on threads of their
own, through the source the planner reads indexes with, and the pipeline's source opened
after the plan takes them from it (``ShardSource.adopt_indexes``, ``ShardSource.early_head``),
finished or not. The first batch then waits for one round trip after the manifest instead of
two. ``settle`` joins the threads (before a fork).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from .readahead import head_request, head_stop


class EarlyReads:
    """The reads started early for one ``ShardSource``: its record indexes (``indexes``, read
    into the source's own cache) and head reads (``take_head``)."""

    def __init__(self, source: Any) -> None:
        self.source = source
        # shard -> (shard, its head read, the bytes it asks for, the records it is sized for)
        self.heads: dict[int, tuple[int, Future, int, int | None]] = {}
        self.indexes: set[int] = set()  # shards whose index is read (or being read) early
        self.threads: list[threading.Thread] = []

    @property
    def started(self) -> bool:
        return bool(self.indexes or self.heads)

    def start(self, shard: int, records: int | None = None) -> bool:
        """Start reading shard ``shard``'s record index and its first bytes (the head read,
        sized for the first ``records`` records: ``readahead.head_stop``), each on a thread.
        False where no head read is worth making (a local shard, its first frame cached, its
        index read already) or one is under way."""
        source = self.source
        if shard in self.heads or source.has_index(shard):
            return False
        stop = head_stop(source, shard, records)
        if stop is None:
            return False
        name, what, size = head_request(source, shard, stop)
        head: Future = Future()
        read = source.fetcher.read

        def read_head() -> None:
            try:
                head.set_result(read(name, 0, stop, what=what, file_size=size))
            except BaseException as exc:  # noqa: BLE001 - the reader that takes it reads again
                head.set_exception(exc)

        def read_index() -> None:
            try:
                source.index(shard)
            except Exception:  # noqa: BLE001 - the reader's own index() raises it, with context
                pass

        self.heads[shard] = (shard, head, stop, records)
        self.indexes.add(shard)
        for target, label in ((read_index, "index"), (read_head, "head")):
            thread = threading.Thread(target=target, name=f"sf-early-{label}", daemon=True)
            thread.start()
            self.threads.append(thread)
        return True

    def take_head(self, shard: int) -> tuple[int, Future, int, int | None] | None:
        """``(shard, head read, bytes it asks for, records it is sized for)`` of shard
        ``shard``, taken at most once; else None."""
        return self.heads.pop(shard, None)

    def settle(self) -> None:
        """Wait for the reads started here; drop the head reads no reader took. The indexes
        are in the source's cache then (or failed: a reader reads them again)."""
        for thread in self.threads:
            thread.join()
        self.threads.clear()
        self.heads.clear()
        self.indexes.clear()
