"""The order of a shuffle window: how many documents it holds and in which order they leave.

Window sizes and keys are pure functions of integers and seeds; the order of a window is a
pure function of its key and its records' lengths, which come from the shard indexes (never
from tokens). A saved state, a restore and an elastic re-plan therefore find the same
windows in the same order.

* ``window_size``: window k of a pass holds ``min(size, warmup * 2**k)`` documents while
  warming up, then ``size``.
* ``window_key``: the permutation key of a window, from (seed, stream, pass, global worker,
  window) and, after a statistical resume, its generation.
* ``window_order``: a window's records, their lengths, and the emission order of the
  non-empty ones (``nonempty_order``).
"""

from __future__ import annotations

import numpy as np

from ..errors import ShardCorruptError
from ..planning.rng import derive_key, permutation


def window_size(size: int, warmup: int, window: int) -> int:
    """Documents in window ``window`` of a pass: ``size``, or while warming up (``warmup`` >
    0) ``warmup * 2**window`` up to ``size``. A saved window's rest (``window`` < 0) keeps its
    own ranges."""
    if warmup <= 0 or window < 0:
        return size
    return min(size, warmup << min(window, 63))


def window_key(seed: int, stream_key: str, pass_idx: int, global_worker: int, window: int,
               generation: int = 0) -> int:
    """The permutation key of window ``window`` of ``pass_idx`` of one worker's stream; each
    statistical resume (``generation`` > 0) reshuffles the windows."""
    extra = ("generation", generation) if generation else ()
    return derive_key("window", seed, stream_key, pass_idx, global_worker, window, *extra)


def nonempty_order(lengths: np.ndarray, key: int) -> np.ndarray:
    """Indexes of the non-zero ``lengths``, permuted by ``key``: the emission order."""
    keep = np.flatnonzero(lengths > 0)
    return keep[permutation(len(keep), key)]


def window_records(source, ranges) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, record, num_tokens) of every record in ``ranges``, from the shard indexes.

    A shard whose index cannot be read counts as empty when the source skips damaged data
    (``source.on_error == "skip"``: its records are skipped on read too), so fresh fills and
    restores agree.
    """
    shard, record, lengths = [], [], []
    for s, a, b in ranges:
        shard.append(np.full(b - a, s, np.int64))
        record.append(np.arange(a, b, dtype=np.int64))
        try:
            lengths.append(source.index(s).records["num_tokens"][a:b].astype(np.int64))
        except ShardCorruptError:
            if source.on_error != "skip":
                raise
            lengths.append(np.zeros(b - a, np.int64))
    if not shard:
        z = np.zeros(0, np.int64)
        return z, z, z
    return np.concatenate(shard), np.concatenate(record), np.concatenate(lengths)


_ORDERS: dict = {}  # (id(manifest), ranges, key) -> (manifest, (shard, record, lengths, order))
_ORDERS_KEPT = 8


def window_order(source, ranges, key: int, keep: bool = False) -> tuple:
    """``(shard, record, num_tokens, order)`` of a window: its records (``window_records``)
    and the emission order of the non-empty ones, read-only.

    Args:
        source: the stream's shards (``index(shard)``, ``on_error``; ``manifest`` where the
            result may be kept).
        ranges: the window's record ranges ``(shard, start, stop)``.
        key: the window's permutation key (``window_key``).
        keep: leave the result for the next call that asks for the same window, which takes
            it (a resume computes the order when it checks a state, then again when it lays
            the window out). At most the last few are kept, and never where damaged shards
            may be skipped (the records then depend on what was found damaged).
    """
    manifest = getattr(source, "manifest", None)
    if manifest is None or source.on_error == "skip":
        shard, record, lengths = window_records(source, ranges)
        return shard, record, lengths, nonempty_order(lengths, key)
    memo = (id(manifest), tuple(tuple(int(x) for x in r) for r in ranges), int(key))
    hit = _ORDERS.pop(memo, None)
    if hit is not None and hit[0] is manifest:
        return hit[1]
    shard, record, lengths = window_records(source, ranges)
    out = (shard, record, lengths, nonempty_order(lengths, key))
    for a in out:
        a.setflags(write=False)
    if keep:
        _ORDERS[memo] = (manifest, out)
        while len(_ORDERS) > _ORDERS_KEPT:
            del _ORDERS[next(iter(_ORDERS))]
    return out
