"""A rank's logical workers in DataLoader worker processes.

``_Job`` is what a logical worker needs to build its share of the pass; ``process_batches``
runs the W logical workers in torch DataLoader processes and yields their ``WorkerBatch``es
in the clock's order (batch ``i`` of the pass from logical worker ``i % W``).

Batches travel several to a message (1, 2, 4... up to ``_Job.per_message``), so the cost of
one trip through torch's worker queue (pickling, a pipe, the queue's feeder thread) is shared
by several batches, and the first batch is not held back. A worker whose share is done
answers with end markers instead of stopping, so torch's round-robin never reshuffles.

A batch's arrays do not travel through the queue's pipe: each worker process writes them into
a ring of shared memory (``_Ring``, handed to the main process once, with the first message
that uses it) and the message carries where they are; the main process copies out the small
piece columns, reads the tokens where they lie (they are read once, by ``expand``) and
acknowledges the slot once it has handed on the message's last batch. The pipe then carries
about 1 KB per batch instead of the batch's tokens, and a message costs no shared-memory
hand-over of its own (a shared tensor per message would cost one each; docs/design.md gives
the figure). A message is written field by field (each field of all its batches end to end), so
shipping and receiving it costs a copy per field, not per array; the tokens, the largest
field, are built in the slot in the first place where it is free (``_Ring.tokens_out``). A
worker's first message, and one that cannot get a slot in time, travel whole, pickled.

At the end of a pass the workers are stopped and joined on a thread of their own
(``_exit_in_background``), so the pass does not wait for the processes to exit.

Workers are processes, not threads: pipelines on threads of one process contend for the GIL
in their Python parts, and their fetch threads wait on it after each decode, so on a machine
of few cores they run slower than processes (docs/design.md, "Exact resume", has the figures).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import itertools
import math
import operator
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..errors import PipelineInvariantError
from ..pipeline.batch import RowBatch
from ..pipeline.dataset import PackedTokenDataset
from ..planning.steps import StepSchedule


@dataclass(slots=True)
class WorkerBatch:
    """One batch a logical worker built, with what the loader keeps of it.

    Args:
        logical: the logical worker that built it.
        step: its global step (None for an end marker).
        rows: the compact batch (None for an end marker).
        state: the worker's pipeline state right after this batch (what a resume restores
            it from).
        stats, skipped: the worker's storage counters and skipped records, where the worker
            sent them (with the first batch of each message from a worker process).
        tally: the batch's counts, added by the loader where it prepares the batch.
        end: marks a worker whose share is done (no ``rows``).
    """

    logical: int
    step: int | None
    rows: RowBatch | None
    state: dict | None
    stats: dict | None = None
    skipped: list | None = None
    tally: Any = None
    end: bool = False


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
    batch_sizes: StepSchedule  # rows per batch, by step
    plan: Any = None  # an evaluation pass's plan (its rows are dealt in it)
    per_message: int = 1  # batches a worker process sends in one message

    @property
    def batch_size(self) -> int:
        """Rows per batch where the batch size is one for the whole job (else at step 0)."""
        return self.batch_sizes.at(0)

    def slot_bytes(self) -> int:
        """A ring slot holds a whole message: its tokens, and as much again for its pieces."""
        row_bytes = (self.dataset.config.seq_len + 1) * self.dataset.token_dtype.itemsize  # the longest rows
        return 2 * self.per_message * self.batch_sizes.largest * row_bytes + (64 << 10)

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


def _start_workers(loader: DataLoader):
    """The loader's iterator, its worker processes started with the trainer's objects frozen.

    A forked worker starts with every object the trainer had. Its first collection of the
    oldest generation (due within milliseconds when the trainer's was due) walks them all and
    writes to their pages, copying each page it shares with the trainer, which delays its
    first batch and costs CPU time through the pass (docs/design.md). Those objects are never
    garbage in a worker, so they are frozen (``gc.freeze``) while the workers are forked: the
    workers keep them frozen, and this process gets them back as they were. A trainer that
    froze objects itself is left alone. The young generations are collected first (a cheap
    collection): unfreezing hands every frozen object back in the oldest generation, without
    counting it towards that generation's next collection, so cyclic garbage frozen young
    (the head start's pipeline, ``ShardSource`` and ``ReadAhead`` referring to each other)
    would be kept for good, and memory would grow every pass (``tools/soak_memory.py`` checks it does not).

    Torch seeds numpy's global generator in each worker it starts, and numpy imports
    ``numpy.random`` on first use, a sizeable part of each worker's start; it is imported
    once here, before the fork, so that the workers inherit it.
    """
    import numpy.random  # noqa: F401

    if gc.get_freeze_count():
        return iter(loader)
    gc.collect(1)  # what unfreezing hands back must be old already (above)
    gc.freeze()
    try:
        return iter(loader)
    finally:
        gc.unfreeze()


class _WorkerBatches(IterableDataset):
    """What runs inside each DataLoader worker process. Batches travel several to a message (a
    list of items; 1, 2, 4... up to ``job.per_message``, so the first batch is not held back),
    so the cost of one trip through torch's worker queue is shared by several batches; the worker's storage counters, taken when the message is
    complete, ride on its first item (so they may count the rest of the message)."""

    def __init__(self, job: "_Job", ring_slots: int) -> None:
        self.job = job
        self.ring_slots = ring_slots  # prefetch_factor + 1: a worker never waits for a slot

    def __iter__(self):
        job = self.job
        info = get_worker_info()
        logical = (info.id + job.rotation) % job.num_logical
        pipeline = job.pipeline(logical)
        ring = _Ring(info.id, self.ring_slots, job.slot_bytes())
        batch_sizes, seq_lens, dtype = job.batch_sizes, job.dataset.seq_lens, job.dataset.token_dtype
        fixed = batch_sizes.constant is not None and seq_lens.constant is not None
        rows_shape = (batch_sizes.at(0), seq_lens.at(0) + 1)
        message: list[WorkerBatch] = []
        size = 1  # the first message holds one batch, the next ones twice as many, up to per_message
        try:
            while True:
                step = pipeline.step
                if not fixed:  # a schedule: this step's shape
                    rows_shape = (batch_sizes.at(step), seq_lens.at(step) + 1)
                out = ring.tokens_out(len(message), rows_shape, dtype)
                rows = pipeline.next_batch(rows_shape[0], out)
                if rows is None:
                    break
                message.append(WorkerBatch(logical, step, rows, pipeline.state_dict()))
                if len(message) == size:
                    yield ring.ship(_with_stats(message, pipeline))
                    message, size = [], min(2 * size, job.per_message)
            if message:
                yield ring.ship(_with_stats(message, pipeline))
        finally:
            pipeline.close()
        while True:  # keep torch's round-robin fixed: answer, never stop
            yield [WorkerBatch(logical, None, None, None, end=True)]


def _with_stats(message: list[WorkerBatch], pipeline) -> list[WorkerBatch]:
    message[0].stats, message[0].skipped = pipeline.stats(), pipeline.skipped()
    return message


class _Ring:
    """A worker process's shared memory for the arrays of its messages: ``slots`` slots of
    ``slot_bytes``, and a header of int64s: how many messages the main process has copied out
    (``acked``, written by it), then ``slots`` and ``slot_bytes``. Message ``k`` goes to slot
    ``k % slots`` once message ``k - slots`` is acknowledged; torch keeps at most
    ``prefetch_factor`` messages of a worker outstanding, so with ``prefetch_factor + 1``
    slots a worker never waits. The first message (one batch) travels whole, so the ring's
    set-up never delays the first batch."""

    HEADER = 64
    WAIT = 2.0  # seconds a message waits for a slot before it travels whole instead

    def __init__(self, worker: int, slots: int, slot_bytes: int) -> None:
        self.worker, self.slots, self.slot_bytes = worker, slots, slot_bytes
        self.shared: torch.Tensor | None = None
        self.sent = 0  # messages through the ring
        self.messages = 0  # messages in all
        self.announced = False
        self.packing = False  # the message being built has its tokens built in its slot
        self.used, self.shape = 0, None  # bytes of the slot its tokens take so far, their first shape
        self.outs: list[np.ndarray] = []  # the token arrays handed out for the message being built

    def _allocate(self) -> None:
        self.shared = _shared_bytes(self.HEADER + self.slots * self.slot_bytes)
        self.memory = self.shared.numpy()
        header = self.memory[: self.HEADER].view(np.int64)
        header[1], header[2] = self.slots, self.slot_bytes  # read by the main process
        self.acked = header[:1]

    def tokens_out(self, index: int, shape: tuple[int, int], dtype: np.dtype) -> np.ndarray | None:
        """Where batch ``index`` of the message being built should build its tokens: its place
        in the next slot (tokens are the slot's first field), so that ``ship`` finds them
        there and copies none; None for a message that travels whole (the first) or whose slot
        is not free yet (its tokens are then copied in, as ever). The slot is chosen at the
        message's first batch, without waiting."""
        if index == 0:
            if self.shared is None and self.messages > 0:
                self._allocate()
            self.packing = self.shared is not None and self._slot_free()
            self.used, self.shape, self.outs = 0, shape, []
        nbytes = math.prod(shape) * dtype.itemsize
        # batches of a message lie end to end (a batch-size schedule may change their rows;
        # a row length that changes sends the message whole: ``ship``)
        if not self.packing or shape[1:] != self.shape[1:] or self.used + nbytes > self.slot_bytes:
            self.used = self.slot_bytes  # and so for the message's later batches
            return None
        at = self.HEADER + (self.sent % self.slots) * self.slot_bytes + self.used
        self.used += nbytes
        out = self.memory[at : at + nbytes].view(dtype).reshape(shape)
        self.outs.append(out)
        return out

    def _slot_free(self) -> bool:
        """The next message's slot is free: the main process acknowledged message ``sent - slots``."""
        return self.sent - int(self.acked[0]) < self.slots

    def _free_slot(self) -> bool:
        if self.shared is None:
            self._allocate()
        deadline = None
        while not self._slot_free():
            now = time.monotonic()
            deadline = deadline or now + self.WAIT
            if now > deadline:
                return False
            time.sleep(0.0002)
        return True

    def ship(self, message: list[WorkerBatch]):
        """``message`` as it goes on the queue: ``("ring", worker, seq, shared or None, used,
        batches, layout)``, the batches' arrays written to the slot field by field (each field
        of all the message's batches end to end: one copy a field, not one an array) and the
        rest of its items as columns (``batches``: the logical worker, each batch's step and
        state, the first's storage counters and skipped records); ``layout`` says where each
        field lies in the slot and each batch's length in it. ``("whole", items)`` when the message does not fit, or
        its batches do not share each field's dtype and row shape."""
        fields = list(zip(*[_columns(item.rows) for item in message]))
        sizes = [sum(map(_nbytes, arrays)) for arrays in fields]
        self.messages += 1
        if self.messages == 1 or sum(sizes) + _ALIGN * len(sizes) > self.slot_bytes or not self._free_slot():
            return ("whole", self._detached(message))
        base = self.HEADER + (self.sent % self.slots) * self.slot_bytes
        at, layout = 0, []
        for arrays, nbytes in zip(fields, sizes):
            at = -(-at // _ALIGN) * _ALIGN
            first = arrays[0]
            lengths = [len(a) for a in arrays]
            shape = (sum(lengths),) + first.shape[1:]
            try:  # batches of other dtypes or row widths cannot lie end to end
                out = self.memory[base + at : base + at + nbytes].view(first.dtype).reshape(shape)
                if not (at == 0 and self.packing and self._in_place(arrays, out)):
                    np.concatenate(arrays, out=out, casting="no")  # an input in place is copied right
            except (ValueError, TypeError):
                return ("whole", self._detached(message))
            layout.append((at, shape, first.dtype.str, lengths))
            at += nbytes
        self.packing = False
        shared = None if self.announced else self.shared
        self.announced = True
        self.sent += 1
        first = message[0]  # the batches as columns: a list pickles faster than its objects
        batches = (first.logical, [item.step for item in message], [item.state for item in message],
                   first.stats, first.skipped)
        return ("ring", self.worker, self.sent - 1, shared, at, batches, layout)

    def _in_place(self, arrays: tuple[np.ndarray, ...], out: np.ndarray) -> bool:
        """Whether the message's tokens lie where ``out`` starts, end to end: the very arrays
        ``tokens_out`` handed out, in order (a pipeline builds its batch in the array it is
        given), or else arrays found there by their addresses."""
        outs = self.outs
        if len(arrays) == len(outs) and all(a is o for a, o in zip(arrays, outs)):
            return True
        return _in_place(arrays, out)

    def _detached(self, message: list[WorkerBatch]) -> list[WorkerBatch]:
        """``message`` to travel whole: tokens built in the slot are copied out, as the slot is
        written again before the queue's thread pickles the message."""
        if self.packing:
            self.packing = False
            for item in message:
                if np.shares_memory(item.rows.tokens, self.memory):
                    item.rows = dataclasses.replace(item.rows, tokens=item.rows.tokens.copy())
        return message


def _in_place(arrays: list[np.ndarray], out: np.ndarray) -> bool:
    """Whether ``arrays`` lie end to end where ``out`` starts, as ``concatenate`` would put them."""
    at = out.__array_interface__["data"][0]
    for a in arrays:
        if not a.flags.c_contiguous or a.__array_interface__["data"][0] != at:
            return False
        at += a.nbytes
    return True


def _shared_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed shared memory, made shared where they are allocated: building the
    tensor and then sharing it (``share_memory_``) zero-fills it and copies it into a new
    segment, several times slower than allocating the segment directly, on the worker's way
    to its second message. A new segment reads as zeros."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:  # a torch without it
        return torch.zeros(nbytes, dtype=torch.uint8).share_memory_()
    return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes))


_FIELDS = tuple(f.name for f in dataclasses.fields(RowBatch))
_columns = operator.attrgetter(*_FIELDS)  # a batch's arrays, in field order
_nbytes = operator.attrgetter("nbytes")
_ALIGN = 8


class _Rings:
    """The main process's side: each worker's ring. ``receive`` gives a message's batches and
    the slot's release: each batch's tokens are a view of the slot (``expand`` reads them
    once, into the batch's own tensors), its piece columns views of one private copy (the
    ledger keeps them); the caller calls the release once the batches' tokens were read, and
    the worker may then write the slot again. Reading the tokens in place saves copying every
    token once more in the main process (docs/design.md gives the share of a pass)."""

    def __init__(self) -> None:
        self.memory: dict[int, np.ndarray] = {}

    def receive(self, message) -> tuple[list[WorkerBatch], Callable[[], None] | None]:
        if isinstance(message, list):  # end markers
            return message, None
        if message[0] == "whole":
            return message[1], None
        _, worker, seq, shared, used, (logical, steps, states, stats, skipped), layout = message
        if shared is not None:
            self.memory[worker] = shared.numpy()
        memory = self.memory[worker]
        header = memory[: _Ring.HEADER].view(np.int64)
        base = _Ring.HEADER + (seq % int(header[1])) * int(header[2])
        slot = memory[base : base + used]
        tokens_end = layout[1][0] if len(layout) > 1 else used  # tokens are the first field
        private = slot[tokens_end:].copy()
        columns = []
        for i, (at, shape, dtype, lengths) in enumerate(layout):
            dtype = np.dtype(dtype)
            source, at = (slot, at) if i == 0 else (private, at - tokens_end)
            block = source[at : at + dtype.itemsize * math.prod(shape)].view(dtype).reshape(shape)
            ends = list(itertools.accumulate(lengths))
            columns.append([block[e - n : e] for e, n in zip(ends, lengths)])

        def release() -> None:
            header[0] = seq + 1  # the slot may be written again

        items = [WorkerBatch(logical, step, RowBatch(*arrays), state)
                 for step, state, arrays in zip(steps, states, zip(*columns))]
        items[0].stats, items[0].skipped = stats, skipped
        return items, release


def per_message(batch_size: int, seq_len: int, itemsize: int, message_bytes: int = 1 << 20) -> int:
    """Batches per worker message: as many as fit ``message_bytes`` of tokens, 1 to 32."""
    return max(1, min(32, message_bytes // max(1, batch_size * (seq_len + 1) * itemsize)))


class _Received:
    """A message in the main process: its slot's release (None where it travelled whole) and
    how many of its batches are not handed on yet."""

    __slots__ = ("release", "left")

    def __init__(self, release: Callable[[], None] | None, batches: int) -> None:
        self.release, self.left = release, batches

    def handed_on(self) -> None:
        """One more of its batches was handed on; after the last, the slot is released."""
        self.left -= 1
        if self.left == 0 and self.release is not None:
            self.release()


def process_batches(job: _Job, num_workers: int, left: int | None, prefetch_factor: int,
                    context) -> Iterator[WorkerBatch]:
    """``left`` batches (None: no end) from ``num_workers`` DataLoader worker processes."""
    loader = DataLoader(
        _WorkerBatches(job, ring_slots=prefetch_factor + 1), batch_size=None, num_workers=num_workers, collate_fn=_identity,
        prefetch_factor=prefetch_factor, multiprocessing_context=context,
    )
    _join_exits()  # no thread of an earlier iteration's exit runs while these workers are forked
    iterator = _start_workers(loader)
    # the iterator's own ``__next__`` wraps each message in a profiler range (a record_function
    # op, which lets go of the GIL and waits to get it back from the queues' feeder threads)
    take = getattr(iterator, "_next_data", iterator.__next__)
    rings = _Rings()
    # messages arrive in torch's round-robin over workers, each holding several batches of
    # one logical worker; batch i of the pass comes from logical worker i % W. Each batch
    # waits with its message (``_Received``), whose slot is released after its last batch
    pending: list[deque] = [deque() for _ in range(job.num_logical)]
    expected = job.rotation
    try:
        while left is None or left > 0:
            waiting = pending[expected]
            while not waiting:
                items, release = rings.receive(take())
                message = _Received(release, len(items))
                for item in items:
                    pending[item.logical].append((item, message))
            item, message = waiting.popleft()
            if item.end:
                raise PipelineInvariantError(f"worker {item.logical} ended before its share of pass {job.pass_idx}")
            left = None if left is None else left - 1
            expected = (expected + 1) % job.num_logical
            yield item
            # the caller asks for the next batch once it has expanded this one (or dropped it)
            message.handed_on()
    except BaseException:
        iterator._shutdown_workers()  # a failure: the workers are gone when it propagates
        raise
    else:
        _exit_in_background(iterator)
    finally:
        del iterator


# threads joining the worker processes of iterations that ended (``_exit_in_background``)
_exits: set[threading.Thread] = set()


def _exit_in_background(iterator) -> None:
    """Stop ``iterator``'s workers and join them on a thread of their own, so the pass ends
    without waiting for them: a worker process takes milliseconds to exit (the kernel tears
    down its copy of the trainer's address space). The next iteration joins the thread
    before it forks (``_join_exits``), and so does the interpreter before it exits."""

    def run() -> None:
        try:
            iterator._shutdown_workers()
        finally:
            _exits.discard(thread)

    thread = threading.Thread(target=run, name="streamforge-workers-exit", daemon=True)
    _exits.add(thread)
    try:
        thread.start()
    except RuntimeError:  # no new thread now (the interpreter is shutting down): stop them here
        _exits.discard(thread)
        iterator._shutdown_workers()


@atexit.register
def _join_exits() -> None:
    for thread in list(_exits):
        thread.join()
