"""Token cuts: a pass cut at token positions inside documents, so no worker holds a surplus.

With ``cuts="tokens"`` (a dataset option) each stream is laid out in the pass's shard order,
as for record cuts (``layout.py``), but counted in tokens with the EOS the pipeline appends,
and cut at exact token positions. In a finite pass every global worker gets the tokens of
the batches it builds (``PassPlan.batches_of``) plus two tokens per stream, apportioned over
the streams in proportion to their tokens; what no full step can take (less than one global
step, ``R * B * T`` tokens) goes to the owners of one more step, which ends in padding
(``last_step.py``), so every token is assigned to a worker. In an
infinite pass the streams are cut at their token quantiles ``k * tokens / N``: nothing is left
over, and a worker reads on into the next pass where this one ends.

A cut at token ``o`` of a document (``0 < o``) gives the worker before it tokens ``[0, o)``
without an EOS and the worker after it ``[o, L)`` and the EOS. A cut that falls on the EOS
itself moves past it, to the record boundary (one token more for the worker before it: the
extra tokens per stream cover that). A worker's ranges are still record ranges ``(shard,
start, stop)``; the first record of its first range and the last of its last may be shared
with its neighbours, which ``CutRanges.cut = (head, tail)`` says: skip ``head`` tokens of
the first record, keep the last one up to token ``tail`` (0: all of it). The reader applies
them (``stages/cut_source.py``); the ledger sees each piece at its offset in its document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import ConfigError
from .layout import Layout, Range

CUTS = ("records", "tokens")


class CutRanges(list):
    """A worker's ranges of a stream under token cuts: a list of ``(shard, start, stop)``
    whose ``cut = (head, tail)`` trims the first record of the first range (skip ``head``
    tokens) and the last record of the last (keep tokens ``[.., tail)``; 0: to its end)."""

    cut: tuple[int, int] = (0, 0)

    def __reduce__(self):
        return (cut_ranges, (list(self), self.cut))


def cut_ranges(ranges, cut) -> CutRanges:
    """``ranges`` as ``CutRanges`` with ``cut``."""
    out = CutRanges(ranges)
    out.cut = (int(cut[0]), int(cut[1]))
    return out


def cut_of(ranges) -> tuple[int, int] | None:
    """The ``(head, tail)`` of token-cut ranges, None for record ranges."""
    return getattr(ranges, "cut", None)


def trims(ranges) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(shard, record): (lo, hi)}``: the token slice of each cut record of ``ranges`` (``hi``
    0: to its end)."""
    cut = cut_of(ranges)
    if not cut or not ranges or cut == (0, 0):
        return {}
    head, tail = cut
    out: dict[tuple[int, int], tuple[int, int]] = {}
    if head:
        s, a, _ = ranges[0]
        out[(int(s), int(a))] = (head, 0)
    if tail:
        s, _, b = ranges[-1]
        lo = out.get((int(s), int(b) - 1), (0, 0))[0]
        out[(int(s), int(b) - 1)] = (lo, tail)
    return out


@dataclass(frozen=True)
class CutSpec:
    """What token cuts are made for: the job's topology and batch shape (constant), and
    whether passes are finite."""

    world_size: int
    workers_per_rank: int
    batch_size: int
    seq_len: int
    finite: bool = True

    @property
    def n(self) -> int:
        return self.world_size * self.workers_per_rank

    def batches(self, steps: int) -> np.ndarray:
        """Batches each global worker builds in a pass of ``steps`` steps."""
        w = np.arange(self.n, dtype=np.int64) % self.workers_per_rank
        return np.where(steps > w, -(-(steps - w) // self.workers_per_rank), 0)

    def budgets(self, totals: Sequence[int]) -> tuple[int, np.ndarray]:
        """``(steps, budget)``: the steps of the pass and ``budget[s][g]``, the tokens of stream
        ``s`` global worker ``g`` gets (``totals``: each stream's tokens with EOS). A finite
        pass ends in a padded step (``last_owners``): the rest no full step takes."""
        totals = [int(t) for t in totals]
        whole = sum(totals)
        k = len(totals)
        if not self.finite:
            return 0, np.array([_quantiles(t, self.n) for t in totals], np.int64).reshape(k, self.n)
        if whole <= 0:
            return 0, np.zeros((k, self.n), np.int64)
        per_step = self.world_size * self.batch_size * self.seq_len
        steps = whole // per_step if per_step else 0
        while True:
            # running sums of the workers' needs, cut over the streams in proportion: worker
            # g's share of stream s is floor(C[g+1] * t_s / whole) - floor(C[g] * t_s / whole),
            # more than its need times t_s / whole, less one token
            need = (self.batches(steps) * (self.batch_size * self.seq_len)).tolist()
            running, c = [0], 0
            for x in need:
                c += x + (2 * k if x else 0)  # a token per stream for the rounding, one for an EOS step
                running.append(c)
            if c < whole or steps == 0:  # then each stream's last cut falls before its end, even moved past an EOS
                break
            steps -= 1
        running = np.asarray(running, np.int64) + self.last_shares(steps, whole - c)
        ends = np.array([[int(c) * t // whole for c in running.tolist()] for t in totals], np.int64)
        return int(steps) + 1, np.diff(ends, axis=1)

    def last_owners(self, step: int) -> np.ndarray:
        """The global workers that build step ``step``: worker ``step % W`` of every rank."""
        return np.arange(self.world_size, dtype=np.int64) * self.workers_per_rank + step % self.workers_per_rank

    def last_shares(self, steps: int, rest: int) -> np.ndarray:
        """What to add to the running sums of the needs (``n + 1`` of them) so that ``rest``
        tokens go to step ``steps``'s owners in about equal shares (one a rank)."""
        r = self.world_size
        share = np.array([(i + 1) * rest // r - i * rest // r for i in range(r)], np.int64)
        extra = np.zeros(self.n + 1, np.int64)
        extra[self.last_owners(steps) + 1] = share
        return np.cumsum(extra)


def _quantiles(total: int, n: int) -> list[int]:
    """Shares of ``total`` over ``n`` workers ending at ``k * total // n``."""
    ends = [k * total // n for k in range(n + 1)]
    return [b - a for a, b in zip(ends[:-1], ends[1:])]


def check_cuts(cuts: str, packing: str, varies: bool) -> None:
    """``ConfigError`` unless ``cuts`` names a kind of cut usable with these settings."""
    if cuts not in CUTS:
        raise ConfigError(f"cuts must be one of {CUTS}, got {cuts!r}")
    if cuts == "tokens" and packing != "concat":
        raise ConfigError(f"cuts='tokens' needs packing='concat' (got {packing!r}): bestfit and pad rows "
                          "hold padding, so a worker's tokens do not fill a known number of batches")
    if cuts == "tokens" and varies:
        raise ConfigError("cuts='tokens' needs one batch_size and one seq_len (no schedule)")


def cut_spec(dataset, workers_per_rank: int, batch_size) -> CutSpec:
    """The ``CutSpec`` of a dataset's passes for a loader's workers and batch size."""
    constant = getattr(batch_size, "constant", batch_size)
    if constant is None:
        raise ConfigError("cuts='tokens' needs one batch_size (no schedule)")
    return CutSpec(dataset.world_size, int(workers_per_rank), int(constant), int(dataset.config.seq_len),
                   finite=not dataset.config.infinite)


# -- cutting one stream ------------------------------------------------------------------------
EndsOf = Callable[[list], list]
"""``ends(shards)``: for each shard, running sums of its records' token counts with EOS, one
before its first record and one after each (they need not start at 0)."""


def cut_stream(layout: Layout, shard_tokens: np.ndarray, budget: np.ndarray, lengths: EndsOf,
               eos: bool, workers: Sequence[int] | None = None) -> tuple[list[CutRanges], np.ndarray]:
    """Cut one stream at the running sums of ``budget`` (tokens per global worker, with EOS).

    ``shard_tokens``: each shard's tokens with EOS (by shard id). Returns each worker's (all,
    or ``workers``') ``CutRanges`` and its tokens with EOS (after cuts moved past an EOS)."""
    ws = np.arange(layout.n) if workers is None else np.asarray(list(workers), np.int64)
    ks = np.unique(np.concatenate([ws, ws + 1]))
    rec, off, pos = cut_points(layout, shard_tokens, budget, lengths, eos, ks)
    at = {int(k): i for i, k in enumerate(ks.tolist())}
    lo = np.array([at[int(g)] for g in ws.tolist()], np.int64)
    hi = np.array([at[int(g) + 1] for g in ws.tolist()], np.int64)
    return between_cuts(layout, rec[lo], off[lo], pos[lo], rec[hi], off[hi], pos[hi])


def cut_points(layout: Layout, shard_tokens: np.ndarray, budget: np.ndarray, lengths: EndsOf, eos: bool,
               ks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cuts ``ks`` (0..N) of a stream: (record in the pass's order, token offset in it, token
    position after moving off an EOS), each computed on its own."""
    ends = np.concatenate([[0], np.cumsum(np.asarray(budget, np.int64))])
    return _locate(layout, np.asarray(shard_tokens, np.int64), ends[np.asarray(ks, np.int64)], lengths, eos)


def between_cuts(layout: Layout, rec_lo, off_lo, pos_lo, rec_hi, off_hi, pos_hi) -> tuple[list[CutRanges], np.ndarray]:
    """Each worker's ``CutRanges`` between its two cuts, and its tokens."""
    empty = pos_hi <= pos_lo
    hi = np.where(empty, rec_lo, rec_hi + (off_hi > 0))
    pieces = layout.between(rec_lo, hi)
    heads = np.where(empty, 0, off_lo).tolist()
    tails = np.where(empty, 0, off_hi).tolist()
    out = []
    for p, h, t in zip(pieces, heads, tails):
        r = CutRanges(p)
        r.cut = (h, t)
        out.append(r)
    return out, np.where(empty, 0, pos_hi - pos_lo)


def assigned_end(layout: Layout, shard_tokens: np.ndarray, budget: np.ndarray, lengths: EndsOf, eos: bool) -> int:
    """Where the last worker's share of a stream ends (its last cut, moved past an EOS): the
    tokens from there on are the pass's unassigned rest."""
    end = np.array([int(np.asarray(budget, np.int64).sum())], np.int64)
    return int(_locate(layout, np.asarray(shard_tokens, np.int64), end, lengths, eos)[2][0])


def _locate(layout: Layout, shard_tokens: np.ndarray, targets: np.ndarray, lengths: EndsOf,
            eos: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each token position ``targets`` as (record in the pass's order, token offset in it, the
    position itself after moving off an EOS)."""
    tok = shard_tokens[layout.order]
    start = np.concatenate([[0], np.cumsum(tok)])
    total = int(start[-1])
    rec = np.full(len(targets), layout.rec_start[-1], np.int64)
    off = np.zeros(len(targets), np.int64)
    pos = np.minimum(targets, total).astype(np.int64)
    inner = np.flatnonzero((targets > 0) & (targets < total))
    rec[targets <= 0] = 0
    if not len(inner):
        return rec, off, pos
    t = targets[inner]
    j = np.searchsorted(start, t, side="right") - 1  # start[j] <= t < start[j + 1]
    local = t - start[j]
    at_start = local == 0
    rec[inner] = layout.rec_start[j]
    which = np.flatnonzero(~at_start)
    if len(which):
        shards, inverse = np.unique(j[which], return_inverse=True)
        got = lengths(layout.order[shards].tolist())
        count = np.array([len(x) - 1 for x in got], np.int64)
        first = np.cumsum(count) - count
        zero = np.array([int(x[0]) for x in got], np.int64)
        size = np.array([int(x[-1]) for x in got], np.int64) - zero
        shift = np.cumsum(size) - size  # each shard's place in the bank
        bank = np.concatenate([x[1:] for x in got]).astype(np.int64) + np.repeat(shift - zero, count)
        glob = shift[inverse] + local[which]
        r = np.searchsorted(bank, glob, side="right") - first[inverse]  # records ending at or before
        r = np.clip(r, 0, count[inverse] - 1)
        before = np.where(r > 0, bank[np.maximum(first[inverse] + r - 1, 0)] - shift[inverse], 0)
        size = bank[first[inverse] + r] - shift[inverse] - before
        o = local[which] - before
        onto_eos = eos & (o == size - 1) if eos else np.zeros(len(o), bool)
        r = r + onto_eos
        o = np.where(onto_eos | (o == 0), 0, o)
        rec[inner[which]] = layout.rec_start[j[which]] + r
        off[inner[which]] = o
        pos[inner[which]] += onto_eos
    return rec, off, pos


def cut_range_tokens(ranges, totals: Callable[[Sequence[Range]], int], record_tokens: Callable[[int, int], int]) -> int:
    """Tokens (with EOS) of ``ranges`` after their cut: ``totals(ranges)`` counts whole records,
    ``record_tokens(shard, record)`` one record's."""
    whole = totals(list(ranges))
    cut = cut_of(ranges)
    if not cut or not ranges:
        return whole
    out = whole
    for (s, r), (lo, hi) in trims(ranges).items():
        size = record_tokens(s, r)
        out -= size - ((hi or size) - lo)
    return out
