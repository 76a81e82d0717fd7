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
its device (or sleeps) overlaps with them, and the trainer waits far less for its batches
(docs/cuda.md and docs/benchmarks.md give the stall ``tools/bench_stall.py`` measures).

Costs: one thread, ``depth`` extra batches of (pinned) host and device memory, one event per
batch. Storage counters read with ``num_workers=0`` and ``depth > 0`` may include the batches
in flight; mixture counters, steps and the state never do.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any, Callable, Iterator

import torch

from ..errors import ConfigError
from . import collector

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


class Taken:
    """A raw item as ``take()`` gives it, with its batch being prepared (``payload``).

    Args:
        item: the raw item, unchanged.
        payload: what ``hand_out`` makes the batch from: the item's rows with ``depth=0``,
            else the prepared batch and the copy's event (None off CUDA).
    """

    __slots__ = ("item", "payload")

    def __init__(self, item: Any, payload: Any) -> None:
        self.item, self.payload = item, payload


class DeviceFeed:
    """One iteration's feed::

        take = feed.open(raw)
        try:
            while (got := take()) is not None:
                batch = feed.hand_out(got)  # got.item: the raw item
                ...                         # commit got.item's state
        finally:
            feed.close()

    ``take()`` gives the raw items unchanged and in order, each as a ``Taken``, and None at
    the end; ``hand_out(got)`` returns its batch, ready to be read on the caller's current
    stream. ``prepare(rows)`` (rows: ``item.rows``) makes the batch (expand, pin, copy); on
    CUDA with ``depth > 0`` it runs under the side stream, so its copies are issued there.
    With ``depth > 0``, ``take`` is one call into the hand-off: the training thread runs as
    little code as possible between two steps.

    Args:
        prepare: makes a raw item's batch from its rows (expand, pin, copy).
        device: where the batches go; a CUDA device gets the side stream and its events.
        depth: prepared batches in flight; 0 prepares each one on the training thread
            (``check_depth``).
    """

    def __init__(self, prepare: Callable[[Any], Batch], device: torch.device, depth: int) -> None:
        self.prepare = prepare
        self.device = device
        self.depth = depth
        self.cuda = device.type == "cuda"
        self._raw: Iterator[tuple] | None = None
        self._hand: _Handoff | None = None
        self._thread: threading.Thread | None = None

    # -- the training thread -------------------------------------------------------------------
    def open(self, raw: Iterator[tuple]) -> Callable[[], tuple | None]:
        if self.depth == 0:
            self._raw = raw

            def take() -> Taken | None:
                item = next(raw, None)
                return None if item is None else Taken(item, item.rows)

            return take
        self._hand = hand = _Handoff(self.depth)
        self._thread = threading.Thread(target=self._produce, args=(raw, hand), name="streamforge-device-feed",
                                        daemon=True)
        self._thread.start()
        return hand.take

    def hand_out(self, got: Taken) -> Batch:
        """The batch of ``got`` (what ``take`` returned), which it drops: the caller then
        holds the only reference, so a batch it is done with is freed in its own time, not
        inside the next ``take`` (freeing a CPU batch costs tens of microseconds)."""
        payload, got.payload = got.payload, None
        if self.depth == 0:
            return self.prepare(payload)
        batch, event = payload
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for tensor in batch.values():
                tensor.record_stream(stream)
        return batch

    def close(self) -> None:
        """Stop the background thread (it closes the raw items) or close them here."""
        if self._hand is not None:
            self._hand.stop()
            self._thread.join()
            self._hand = self._thread = None
        elif self._raw is not None:
            _close(self._raw)
            self._raw = None

    # -- the background thread -----------------------------------------------------------------
    def _produce(self, raw: Iterator[tuple], hand: "_Handoff") -> None:
        side = torch.cuda.Stream(self.device) if self.cuda else None
        try:
            for item in raw:
                if side is not None:
                    with torch.cuda.stream(side):
                        batch = self.prepare(item.rows)
                        event = side.record_event()
                else:
                    batch, event = self.prepare(item.rows), None
                if not hand.put(Taken(item, (batch, event))):
                    break
            else:
                hand.put(None)
        except BaseException as error:  # handed to the training thread, raised there
            hand.put(_Failure(error))
        finally:
            _close(raw)  # shuts worker processes down from the thread that ran them


class _Handoff:
    """A queue of at most ``depth`` items from one producer thread to one consumer, whose
    ``take`` is a lock-free ``popleft`` whenever an item is ready: the training thread comes
    back from a step with cold caches, where each lock and condition costs tens of
    microseconds. The producer appends under a condition (so a waiting consumer never misses
    it) and, when full, waits on ``_space``, a plain lock the consumer releases after a take."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.items: deque = deque()
        self._ready = threading.Condition()
        self._space = threading.Lock()
        self._space.acquire()  # locked: "no room was made since the producer last looked"
        self._stopped = False

    def take(self) -> Any:
        """The next item (None at the end); raises the producer's error."""
        items = self.items
        if not items:
            with self._ready:
                while not items:
                    self._ready.wait()
        got = items.popleft()
        if self._space.locked():
            self._space.release()
        if type(got) is _Failure:
            raise got.error
        return got

    def put(self, value: Any) -> bool:
        """False once the consumer stopped (the value is dropped)."""
        while len(self.items) >= self.depth and not self._stopped:
            self._space.acquire(timeout=0.05)
        if self._stopped:
            return False
        with self._ready:
            self.items.append(value)
            self._ready.notify()
        return True

    def stop(self) -> None:
        self._stopped = True
        self.items.clear()
        if self._space.locked():
            self._space.release()


def _close(raw: Iterator[tuple]) -> None:
    close = getattr(raw, "close", None)
    if close is not None:
        close()


def taken(take: Callable[[], Any], pause: bool) -> Iterator[Any]:
    """What ``take`` returns until None; with ``pause``, the first with the garbage collector
    paused, since it sets the pass up (pipelines, first windows: ``collector``). Only for a
    pipeline in this process: with workers the first take is the head start, and the workers
    are forked right after it, with the collector as it would be without streamforge."""
    if pause:
        with collector.paused():
            got = take()
    else:
        got = take()
    while got is not None:
        yield got
        got = take()

