"""A stream's shards laid end to end in a pass's order, and every cut of it at once.

``plan.plan_stream`` is the specification: cut ``k`` of ``N`` is the record boundary nearest
the token quantile ``k * tokens / N``, exactly where the record lengths of the shard it falls
in are known, else estimated by spreading the shard's tokens evenly over its records; global
worker ``k`` reads the records between cuts ``k`` and ``k + 1``. This module computes those
cuts, and the ranges between them, as a handful of numpy steps over all the cuts wanted, not
one Python call per cut: at 8,192 global workers over three streams that was 49,152 cuts,
each with its own searches and, inside a shard, its own cumulative sum of the shard's record
lengths (``tests/test_layout_fast.py`` holds the per-cut code as the reference and checks
the two agree exactly on random corpora).

Arithmetic is the reference's, operation for operation: targets ``total * k / N`` in float64,
shard positions by ``searchsorted`` over the same float64 prefix sums, record ends as float64
cumulative sums (equal to the integer prefix sums while they stay below 2**53), and numpy's
round half to even where Python's ``round`` was.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from .rng import derive_key, permutation

Range = tuple[int, int, int]  # (shard, start_record, stop_record), stop exclusive
RecordEnds = Callable[[list], list]
"""``ends(shards)``: for each shard, running sums of its records' token counts (integers), one
before its first record and one after each record: ``ends[i + 1] - ends[0]`` is the tokens of
its first ``i + 1`` records (the sums need not start at 0). It may also have a ``bank(shards)``
method giving what ``_bank`` would build from them, or None: (a non-decreasing array holding
each shard's ends, each shard's first position in it, record count and value before it)."""


class Layout:
    """A stream's shards in the pass's order, laid end to end in record and token space."""

    def __init__(self, shard_records, shard_tokens, seed, stream_key, pass_idx, num_global_workers,
                 fraction: float = 1.0) -> None:
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
        # ``fraction`` < 1: only the first that part of the order, in tokens, is cut among the
        # workers (a partial reading, ``readings.py``); its last cut N falls inside it like the others
        self.whole = fraction >= 1
        self.total = self.tok_start[-1] * (1.0 if self.whole else max(0.0, float(fraction)))

    # -- where the cuts fall --------------------------------------------------------------
    def _locate(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For inner cuts ``ks`` (1..N-1, and N in a partial pass): the position of the shard each falls in, its token
        target, and whether it falls strictly inside a shard of several records."""
        targets = self.total * ks / self.n
        j = np.minimum(np.searchsorted(self.tok_start[1:], targets, side="left"), len(self.rec) - 1)
        tok_j = self.tok[j]
        inside = (tok_j > 0) & (self.tok_start[j] < targets) & (targets < self.tok_start[j + 1]) & (self.rec[j] > 1)
        return j, targets, inside

    def cut_shards(self, ks: Iterable[int]) -> set[int]:
        """The shards (ids) the cuts ``ks`` fall strictly inside: the ones whose record
        lengths an exact cut needs."""
        ks = _inner(ks, self.n, self.whole)
        if not len(ks) or not len(self.rec):
            return set()
        j, _, inside = self._locate(ks)
        return set(self.order[j[inside]].tolist())

    def cuts(self, ks: Iterable[int], record_ends: RecordEnds | None = None) -> np.ndarray:
        """Cuts ``ks`` in record space (int64; 0 and the stream's record count at the ends),
        exact where ``record_ends`` gives the lengths of the shard a cut falls inside."""
        ks = np.asarray(list(ks) if not isinstance(ks, (range, np.ndarray)) else ks, dtype=np.int64)
        out = np.zeros(len(ks), np.int64)
        if not len(self.rec):
            return out
        if self.whole:
            out[ks >= self.n] = self.rec_start[-1]
            mid = np.flatnonzero((ks > 0) & (ks < self.n))
        else:  # past the last cut of a partial pass: that cut
            ks = np.minimum(ks, self.n)
            mid = np.flatnonzero(ks > 0)
        if not len(mid):
            return out
        j, targets, inside = self._locate(ks[mid])
        rec_j, tok_j, start_j = self.rec[j], self.tok[j], self.tok_start[j]
        # a shard without tokens: all of it before a target past its start, else none
        within = np.where(targets > start_j, rec_j, 0)
        spread = tok_j > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.where(spread, (targets - start_j) / tok_j, 0.0)
        estimate = np.rint(np.clip(frac, 0.0, 1.0) * rec_j).astype(np.int64)
        within = np.where(spread, estimate, within)
        if record_ends is not None and inside.any():
            self._exact(within, j, targets, np.flatnonzero(inside), record_ends)
        out[mid] = self.rec_start[j] + np.minimum(within, rec_j)
        return out

    def _exact(self, within, j, targets, which, record_ends: RecordEnds) -> None:
        """Set ``within`` of the cuts ``which`` to the record boundary nearest their target,
        from their shards' record ends, all at once: the shards' ends are laid end to end
        (``bank``), each cut's search runs over the whole bank, confined to its shard."""
        pos, inverse = np.unique(j[which], return_inverse=True)
        shards = self.order[pos].tolist()
        laid = getattr(record_ends, "bank", None)  # the ends already laid end to end, if so
        got = laid(shards) if laid is not None else None
        bank, first, count, base = got if got is not None else _bank(
            [np.asarray(e, np.int64) for e in record_ends(shards)])
        local = targets[which] - self.tok_start[j[which]]
        # the records of the shard ending before the target: ends are integers, so end < local
        # exactly when end <= ceil(local) - 1, a search over the bank's running sums
        below = np.ceil(local).astype(np.int64) - 1 + base[inverse]
        i = np.searchsorted(bank, below, side="right") - first[inverse]
        i = np.clip(i, 0, count[inverse])
        size = max(len(bank), 1)
        at = (bank[np.minimum(first[inverse] + i, size - 1)] - base[inverse]).astype(np.float64) if len(bank) else 0.0
        prev = bank[np.clip(first[inverse] + i - 1, 0, size - 1)] - base[inverse] if len(bank) else 0
        before = np.where(i > 0, prev, 0).astype(np.float64)
        up = (i < count[inverse]) & ~(local - before <= at - local)
        within[which] = i + up


    # -- the ranges between them ------------------------------------------------------------
    def ranges(self, workers: Iterable[int] | None = None, record_ends: RecordEnds | None = None) -> list[list[Range]]:
        """Every global worker's ranges (or ``workers``', in that order): the records between
        its two cuts, as (shard, start, stop) pieces in reading order."""
        if workers is None:
            cuts = self.cuts(range(self.n + 1), record_ends)
            return self.between(cuts[:-1], cuts[1:])
        ws = np.asarray(list(workers), np.int64)
        uniq, back = np.unique(np.concatenate([ws, ws + 1]), return_inverse=True)
        cuts = self.cuts(uniq, record_ends)[back]
        return self.between(cuts[: len(ws)], cuts[len(ws):])

    def between(self, lo: np.ndarray, hi: np.ndarray) -> list[list[Range]]:
        """The (shard, start, stop) pieces of each record-space interval ``[lo[i], hi[i])``:
        the shards whose span meets it, each cut to it (all intervals in one numpy pass)."""
        lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        count = len(lo)
        if not count:
            return []
        live = hi > lo
        first = np.searchsorted(self.rec_start, lo, side="right") - 1  # the shard holding record lo
        end = np.minimum(np.searchsorted(self.rec_start, hi, side="left"), len(self.rec))
        span = np.where(live, end - first, 0)
        total = int(span.sum())
        owner = np.repeat(np.arange(count), span)
        offset = np.arange(total) - np.repeat(np.cumsum(span) - span, span)
        pos = np.repeat(first, span) + offset
        begin = self.rec_start[pos]
        start = np.maximum(begin, lo[owner]) - begin
        stop = np.minimum(self.rec_start[pos + 1], hi[owner]) - begin
        keep = stop > start
        pieces = list(zip(self.order[pos[keep]].tolist(), start[keep].tolist(), stop[keep].tolist()))
        bounds = np.concatenate([[0], np.cumsum(np.bincount(owner[keep], minlength=count))]).tolist()
        return [pieces[bounds[i]:bounds[i + 1]] for i in range(count)]


def _inner(ks: Iterable[int], n: int, whole: bool = True) -> np.ndarray:
    """The cuts of ``ks`` strictly between the ends (1..n-1; 1..n where the pass is partial,
    its end inside the order), as an int64 array."""
    ks = np.asarray(sorted(set(int(k) for k in ks)), np.int64)
    return ks[(ks > 0) & ((ks < n) if whole else (ks <= n))]


def _bank(ends: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shards' record ends (``RecordEnds``) as one non-decreasing array: each shard's running
    sums from 0, shifted by the tokens of the shards before it. Returns the bank, each shard's
    first position and record count in it, and its shift."""
    count = np.array([len(e) - 1 for e in ends], np.int64)
    first = np.cumsum(count) - count
    zero = np.array([int(e[0]) for e in ends], np.int64)
    last = np.array([int(e[-1]) for e in ends], np.int64) - zero
    base = np.cumsum(last) - last
    if not len(ends):
        return np.zeros(0, np.int64), first, count, base
    bank = np.concatenate([e[1:] for e in ends]) + np.repeat(base - zero, count)
    return bank, first, count, base
