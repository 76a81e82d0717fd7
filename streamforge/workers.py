"""A rank's logical workers in DataLoader worker processes.

``_Job`` is what a logical worker needs to build its share of the pass; ``process_batches``
runs the W logical workers in torch DataLoader processes and yields ``(logical, step, rows,
state, stats, skipped)`` in the clock's order (batch ``i`` of the pass from logical worker
``i % W``).

Batches travel several to a message (1, 2, 4... up to ``_Job.per_message``), so the cost of
one trip through torch's worker queue (pickling, a pipe, the queue's feeder thread) is shared
by several batches, and the first batch is not held back. A worker whose share is done
answers with end markers instead of stopping, so torch's round-robin never reshuffles.

Threads instead of processes were measured and lose on this kind of machine: two pipelines
on threads of one process ran at 27M tokens/s against 36-48M for two processes and about
90M for the pipeline on one thread (20M-token pass, 2 cores): the pipelines' Python parts
contend for the GIL, and the fetch threads wait on it after each decode.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .dataset import PackedTokenDataset


@dataclass
class _Job:
    """What a worker needs to build its share of the pass (pickled to worker processes)."""

    dataset: PackedTokenDataset
    num_logical: int
    pass_idx: int
    first_step: int
    quotas: list[int] | None
    states: list[dict | None]
    rotation: int
    batch_size: int
    plan: Any = None  # an evaluation pass's plan (its rows are dealt in it)
    per_message: int = 1  # batches a worker process sends in one message

    def pipeline(self, logical: int):
        """Logical worker ``logical``'s pipeline, restored from its saved state if any."""
        pipeline = self.dataset.make_pipeline(
            logical, self.num_logical, first_pass=self.pass_idx,
            quota=None if self.quotas is None else self.quotas[logical], first_step=self.first_step,
            plan=self.plan,
        )
        if self.states[logical] is not None:
            try:
                pipeline.load_state_dict(self.states[logical])
            except BaseException:
                pipeline.close()
                raise
        return pipeline


def _identity(item):
    return item


class _WorkerBatches(IterableDataset):
    """What runs inside each DataLoader worker process. Batches travel several to a message (a
    list of items; 1, 2, 4... up to ``job.per_message``, so the first batch is not held back),
    so the cost of one trip through torch's worker queue is shared by several batches; the worker's storage counters, taken when the message is
    complete, ride on its first item (so they may count the rest of the message)."""

    def __init__(self, job: "_Job") -> None:
        self.job = job

    def __iter__(self):
        job = self.job
        logical = (get_worker_info().id + job.rotation) % job.num_logical
        pipeline = job.pipeline(logical)
        message: list[tuple] = []
        size = 1  # the first message holds one batch, the next ones twice as many, up to per_message
        try:
            while True:
                step = pipeline.step
                rows = pipeline.next_batch(job.batch_size)
                if rows is None:
                    break
                message.append(("batch", logical, step, rows, pipeline.state_dict(), None, None))
                if len(message) == size:
                    yield _with_stats(message, pipeline)
                    message, size = [], min(2 * size, job.per_message)
            if message:
                yield _with_stats(message, pipeline)
        finally:
            pipeline.close()
        while True:  # keep torch's round-robin fixed: answer, never stop
            yield [("end", logical, None, None, None, None, None)]


def _with_stats(message: list[tuple], pipeline) -> list[tuple]:
    message[0] = message[0][:5] + (pipeline.stats(), pipeline.skipped())
    return message


def per_message(batch_size: int, seq_len: int, itemsize: int, message_bytes: int = 1 << 20) -> int:
    """Batches per worker message: as many as fit ``message_bytes`` of tokens, 1 to 32."""
    return max(1, min(32, message_bytes // max(1, batch_size * (seq_len + 1) * itemsize)))


def process_batches(job: _Job, num_workers: int, left: int | None, prefetch_factor: int, context) -> Iterator[tuple]:
    """``left`` batches (None: no end) from ``num_workers`` DataLoader worker processes."""
    loader = DataLoader(
        _WorkerBatches(job), batch_size=None, num_workers=num_workers, collate_fn=_identity,
        prefetch_factor=prefetch_factor, multiprocessing_context=context,
    )
    iterator = iter(loader)
    # messages arrive in torch's round-robin over workers, each holding several batches of
    # one logical worker; batch i of the pass comes from logical worker i % W
    pending: list[deque] = [deque() for _ in range(job.num_logical)]
    expected = job.rotation
    try:
        while left is None or left > 0:
            waiting = pending[expected]
            while not waiting:
                for item in next(iterator):
                    pending[item[1]].append(item)
            kind, logical, step, rows, state, stats, skipped = waiting.popleft()
            if kind == "end":
                raise RuntimeError(f"worker {logical} ended before its share of pass {job.pass_idx}")
            left = None if left is None else left - 1
            expected = (expected + 1) % job.num_logical
            yield logical, step, rows, state, stats, skipped
    finally:
        iterator._shutdown_workers()
        del iterator
