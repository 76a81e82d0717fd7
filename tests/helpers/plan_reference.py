"""The shard plan's cuts as they were computed before ``planning/layout.py``: one Python call
per cut, each with its own searches (``a00a3d7``). Kept as the reference the vectorized cuts
must equal exactly (``tests/test_plan_fast.py``)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from streamforge.planning.rng import derive_key, permutation

Range = tuple[int, int, int]


def plan_stream(
    shard_records: Sequence[int] | np.ndarray,
    shard_tokens: Sequence[int] | np.ndarray,
    *,
    seed: int,
    stream_key: str,
    pass_idx: int,
    num_global_workers: int,
    record_tokens: Callable[[int], np.ndarray] | None = None,
    workers: Sequence[int] | None = None,
) -> list[list[Range]]:
    """Record ranges of one stream for every global worker (or for ``workers`` only, in that
    order), in reading order.

    With ``record_tokens(shard)`` (the token count of each of a shard's records), a cut that
    falls inside a shard goes to the record boundary nearest its token quantile, exactly;
    without, the shard's tokens are taken as spread evenly over its records. Each cut is
    computed on its own (a worker's ranges need its two cuts only, so at most two shards'
    record lengths); the cuts are monotone either way.
    """
    layout = _Layout(shard_records, shard_tokens, seed, stream_key, pass_idx, num_global_workers)
    wanted = range(layout.n) if workers is None else workers
    return [_ranges_between(layout.order, layout.rec, layout.rec_start,
                            layout.cut(k, record_tokens), layout.cut(k + 1, record_tokens)) for k in wanted]


def cut_shards(shard_records, shard_tokens, *, seed: int, stream_key: str, pass_idx: int,
               num_global_workers: int, workers: Sequence[int] | None = None) -> set[int]:
    """The shards that the cuts of ``workers`` (default: all) fall inside: the ones whose
    record lengths ``plan_stream(record_tokens=...)`` asks for."""
    layout = _Layout(shard_records, shard_tokens, seed, stream_key, pass_idx, num_global_workers)
    ks = range(1, layout.n) if workers is None else {k for g in workers for k in (g, g + 1)}
    return {s for s in (layout.cut_shard(k) for k in ks) if s is not None}


class _Layout:
    """A stream's shards in the pass's order, laid end to end in record and token space."""

    def __init__(self, shard_records, shard_tokens, seed, stream_key, pass_idx, num_global_workers) -> None:
        records = np.asarray(shard_records, dtype=np.int64)
        tokens = np.asarray(shard_tokens, dtype=np.float64)
        self.n = int(num_global_workers)
        if self.n < 1:
            raise ValueError(f"num_global_workers must be >= 1, got {num_global_workers}")
        self.order = permutation(len(records), derive_key("shard-order", seed, stream_key, pass_idx))
        self.rec = records[self.order]
        self.tok = tokens[self.order]
        self.rec_start = np.concatenate([[0], np.cumsum(self.rec)])  # each shard's place in record space
        self.tok_start = np.concatenate([[0.0], np.cumsum(self.tok)])
        self.total = self.tok_start[-1]

    def _locate(self, k: int) -> tuple[int, float]:
        """(position of the shard the k-th cut falls in, the cut's token target)."""
        target = self.total * k / self.n
        # the last shard whose token span starts at or before the target
        j = int(np.searchsorted(self.tok_start[1:], target, side="left"))
        return min(j, len(self.rec) - 1), target

    def cut_shard(self, k: int) -> int | None:
        """The shard (its id) the k-th cut falls strictly inside, if any."""
        if k <= 0 or k >= self.n or not len(self.rec):
            return None
        j, target = self._locate(k)
        inside = self.tok[j] > 0 and self.tok_start[j] < target < self.tok_start[j + 1] and self.rec[j] > 1
        return int(self.order[j]) if inside else None

    def cut(self, k: int, record_tokens=None) -> int:
        """The k-th cut in record space (0 and the stream's record count at the ends)."""
        if k <= 0 or not len(self.rec):
            return 0
        if k >= self.n:
            return int(self.rec_start[-1])
        j, target = self._locate(k)
        if self.tok[j] <= 0:
            within = int(self.rec[j]) if target > self.tok_start[j] else 0
        elif record_tokens is not None and self.cut_shard(k) is not None:
            ends = np.cumsum(np.asarray(record_tokens(int(self.order[j])), np.float64))
            local = target - self.tok_start[j]
            i = int(np.searchsorted(ends, local, side="left"))  # record i holds the target
            before = ends[i - 1] if i > 0 else 0.0
            within = i if i >= len(ends) or local - before <= ends[i] - local else i + 1
        else:
            frac = (target - self.tok_start[j]) / self.tok[j]
            within = int(round(min(max(frac, 0.0), 1.0) * self.rec[j]))
        return int(self.rec_start[j]) + min(within, int(self.rec[j]))


def _ranges_between(order, rec, rec_start, lo: int, hi: int) -> list[Range]:
    """The (shard, start, stop) pieces of the record-space interval [lo, hi): the shards whose
    span meets it, each cut to it (one numpy step over them: a worker of a 1-worker pass of a
    100,000-shard stream gets 100,000 ranges)."""
    if hi <= lo:
        return []
    first = int(np.searchsorted(rec_start, lo, side="right")) - 1  # the shard holding record lo
    end = min(int(np.searchsorted(rec_start, hi, side="left")), len(rec))  # shards starting before hi
    begin = rec_start[first:end]
    start = np.maximum(begin, lo) - begin
    stop = np.minimum(rec_start[first + 1 : end + 1], hi) - begin
    keep = stop > start
    return list(zip(order[first:end][keep].tolist(), start[keep].tolist(), stop[keep].tolist()))
