"""Device placement with prefetch: batches reach the trainer already on its device.

The algorithm. ``DeviceFeed`` sits between the loader's raw items (a ``RowBatch`` with the
worker state that produced it) and the trainer:

1. a background thread takes the next raw item and *prepares* it: expands it into the batch
   contract, pins it and, on CUDA, issues the host-to-device copies ``non_blocking`` on a side
   stream and records an event after them;
2. a queue of at most ``depth`` prepared items sits between that thread and the trainer, so
   ``depth`` batches are in flight (copied, or being copied) while a step runs;
3. the training thread takes the next item; its current stream waits on the copy's event
   (the copy never blocks the host) and every tensor is marked as used by that stream
   (``record_stream``), so the caching allocator does not hand its memory to the next copy
   while the step still reads it;
4. only then does the loader commit the state that travelled with the item: its state is that
   of the last batch *handed out*, never of batches in flight, so a checkpoint taken between
   steps resumes exactly, whatever the depth.

``depth=0`` prepares each batch on the training thread, synchronously (pin, then copy on the
current stream). On CPU a depth > 0 still runs: the expand (and, with ``num_workers=0``, the
whole pipeline: reading, decompressing, packing) moves off the training thread. Those parts
spend their time in zstd, numpy and torch, which release the GIL, so a trainer that waits on
its device (or sleeps) overlaps with them. Measured on 2 CPU cores (``tools/bench_stall.py``,
docs/cuda.md): at 20 ms steps from local disk the trainer waits 5.3% of the time with 0
workers and 3.3% with 2 workers, but 0.7% and 0.85% with ``depth=2``.

Costs: one thread, ``depth`` extra batches of (pinned) host and device memory, one event per
batch. Storage counters read with ``num_workers=0`` and ``depth > 0`` may include the batches
in flight; mixture counters, steps and the state never do.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, Iterator

import torch

from .errors import ConfigError

Batch = dict[str, torch.Tensor]


def default_device() -> torch.device:
    """The rank's CUDA device when CUDA is available (``LOCAL_RANK``, as torchrun sets it,
    else the current device), else the CPU. The one place the device is read from the
    environment."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.isdigit() and int(local) < torch.cuda.device_count():
        return torch.device("cuda", int(local))
    return torch.device("cuda", torch.cuda.current_device())


def check_depth(depth: int | None, device: torch.device) -> int:
    """``device_prefetch``: None means 2 on CUDA and 0 (synchronous) elsewhere."""
    if depth is None:
        return 2 if device.type == "cuda" else 0
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ConfigError(f"device_prefetch must be an int >= 0, got {depth!r}")
    return depth


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE = object()


class DeviceFeed:
    """One iteration's feed: ``for item in feed.items(raw): ...; batch = feed.hand_out()``.

    ``items`` yields the raw items unchanged and in order; ``hand_out`` returns the prepared
    batch of the item yielded last, ready to be read on the caller's current stream.
    ``prepare(rows)`` makes the batch (expand, pin, copy); on CUDA with ``depth > 0`` it runs
    under the side stream, so its copies are issued there.
    """

    def __init__(self, prepare: Callable[[Any], Batch], device: torch.device, depth: int) -> None:
        self.prepare = prepare
        self.device = device
        self.depth = depth
        self.cuda = device.type == "cuda"
        self._current: tuple[Any, Any] | None = None  # (batch or rows, event)

    # -- the training thread -------------------------------------------------------------------
    def items(self, raw: Iterator[tuple]) -> Iterator[tuple]:
        """The raw items; the rows are the third field (``item[2]``)."""
        if self.depth == 0:
            try:
                for item in raw:
                    self._current = (item[2], None)
                    yield item
            finally:
                _close(raw)
            return
        yield from self._prefetched(raw)

    def hand_out(self) -> Batch:
        if self._current is None:
            raise RuntimeError("hand_out() before the first item")
        payload, event = self._current
        self._current = None
        if self.depth == 0:
            return self.prepare(payload)
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for tensor in payload.values():
                tensor.record_stream(stream)
        return payload

    def _prefetched(self, raw: Iterator[tuple]) -> Iterator[tuple]:
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        thread = threading.Thread(
            target=self._produce, args=(raw, ready, stop), name="streamforge-device-feed", daemon=True
        )
        thread.start()
        try:
            while True:
                got = ready.get()
                if got is _DONE:
                    return
                if isinstance(got, _Failure):
                    raise got.error
                item, batch, event = got
                self._current = (batch, event)
                yield item
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    ready.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()

    # -- the background thread -----------------------------------------------------------------
    def _produce(self, raw: Iterator[tuple], ready: queue.Queue, stop: threading.Event) -> None:
        side = torch.cuda.Stream(self.device) if self.cuda else None
        try:
            for item in raw:
                if stop.is_set():
                    break
                if side is not None:
                    with torch.cuda.stream(side):
                        batch = self.prepare(item[2])
                        event = side.record_event()
                else:
                    batch, event = self.prepare(item[2]), None
                if not _put(ready, (item, batch, event), stop):
                    break
            else:
                _put(ready, _DONE, stop)
        except BaseException as error:  # handed to the training thread, raised there
            _put(ready, _Failure(error), stop)
        finally:
            _close(raw)  # shuts worker processes down from the thread that ran them


def _close(raw: Iterator[tuple]) -> None:
    close = getattr(raw, "close", None)
    if close is not None:
        close()


def _put(ready: queue.Queue, value: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            ready.put(value, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False
