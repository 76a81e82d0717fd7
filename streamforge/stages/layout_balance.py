"""The balanced layout: a window of document pieces laid out in rows of equal attention cost.

Pure functions of lengths (no tokens), so the packer (``balance.py``), the benchmark
(``tools/bench_balance.py``) and the tests run the same code.

The model (``pipeline/cost.py``, without window or linear term): a row of pieces ``L_i``
costs ``sum(L_i ** 2)``, which is ``T`` times the token-weighted mean piece length of the row,
its *density*. Rows of ``T`` tokens cost the same when their densities are equal, so the
target is a density ``D`` and every row aims at ``T * D``.

* ``balance_target``: ``T * D`` from a corpus's document lengths. Cutting documents only lowers
  a window's density, never raises it, so ``D`` is set where nearly every window can reach it:
  the ``QUANTILE`` (5%) quantile of the densities of windows dealt from the sample, each with
  no piece longer than ``piece_cap`` (one piece may cost at most ``PIECE_SHARE`` of a row's
  target, else a row holding it could not be balanced). The cap follows the target, so both
  are iterated to a fixed point. Deterministic: every rank computes the same value.
* ``lay_out``: a window's pieces in rows of exactly ``T`` tokens (the last row of a window that
  does not fill it is short). The pieces are cut into near-equal parts at the smallest cap at
  which the window reaches ``D`` (at most ``piece_cap``), so the window's mean row cost is near
  the target; then the long parts are dealt, longest first, to the row whose cost, were its
  room filled at the density of the parts still to come, would be lowest, and the short parts
  fill the rooms left, the rows that need the most density getting the longest parts.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..pipeline import core

QUANTILE = 0.05  # the share of windows that may fall short of the target
PIECE_SHARE = 0.5  # the most of a row's target one piece may cost: two at the cap fill it
SMALL = 0.25  # parts shorter than this many target densities fill the rows last, together
ROUND = 0.5  # the share of the rows with room dealt one part each in a round
ALONE = 2.0  # parts at least this many target densities long are dealt one by one


def _density(lengths: np.ndarray, cap: int) -> float:
    """Token-weighted mean piece length of ``lengths`` cut at ``cap`` (sum L², over sum L)."""
    n = np.maximum(1, -(-lengths // max(1, cap)))
    base, extra = lengths // n, lengths % n
    squares = extra * (base + 1) ** 2 + (n - extra) * base ** 2
    total = lengths.sum()
    return float(squares.sum() / total) if total else 1.0


def balance_target(lengths: Sequence[np.ndarray], shares: Sequence[float], seq_len: int,
                   window_rows: int) -> float:
    """The cost a row of ``seq_len`` tokens aims at, from each stream's document lengths (a
    sample is enough, in a fixed order) and its share of the tokens: ``seq_len`` times the
    density most windows can reach (``QUANTILE`` of them; ``window_density``).

    The sample is dealt into windows of ``window_rows * seq_len`` tokens the way a worker's
    window takes them (the streams interleaved by their shares, documents cut at the window's
    end), and each window's density with no cap but the row is computed."""
    streams = [(np.asarray(x, np.int64), float(w)) for x, w in zip(lengths, shares)]
    streams = [(x[x > 0], w) for x, w in streams if w > 0]
    streams = [(x, w) for x, w in streams if len(x)]
    total = sum(w for _, w in streams)
    if not streams or total <= 0:
        return float(seq_len) * seq_len
    # interleave by token share: a document of stream s at its running share of tokens
    keys, docs = [], []
    for x, w in streams:
        keys.append((np.cumsum(x) - x / 2) / (w / total))
        docs.append(x)
    order = np.argsort(np.concatenate(keys), kind="stable")
    mixed = np.concatenate(docs)[order]
    size = window_rows * seq_len
    ends = np.cumsum(mixed)
    windows = int(ends[-1] // size)
    if windows < 1:
        return window_density(mixed, seq_len) * seq_len
    cuts = np.arange(1, windows + 1) * size
    target = float(seq_len) * seq_len
    for _ in range(8):  # the cap on a piece follows the target: to a fixed point
        cap = piece_cap(target, seq_len)
        found = _window_densities(mixed, ends, cuts, windows, size, cap)
        new = float(np.quantile(found, QUANTILE)) * seq_len
        if abs(new - target) <= 1e-3 * target:
            return new
        target = new
    return target


def piece_cap(target: float, seq_len: int) -> int:
    """The longest piece a row aiming at ``target`` holds: one costing ``PIECE_SHARE`` of it."""
    return max(1, min(int(seq_len), int((PIECE_SHARE * target) ** 0.5)))


def _window_densities(mixed, ends, cuts, windows, size, cap) -> list[float]:
    found = []
    lo = 0
    for w in range(windows):
        hi = int(np.searchsorted(ends, cuts[w], side="left"))
        part = mixed[lo : hi + 1].copy()
        part[0] = min(part[0], ends[lo] - w * size)
        part[-1] -= ends[hi] - cuts[w]
        found.append(window_density(part, cap))
        lo = hi if ends[hi] > cuts[w] else hi + 1
    return found


def window_density(lengths: np.ndarray, cap: int) -> float:
    """The token-weighted mean piece length of ``lengths`` cut at ``cap``."""
    return _density(np.asarray(lengths, np.int64), cap)


def _cap_for(lengths: np.ndarray, density: float, seq_len: int) -> int:
    """The smallest cap (at most ``seq_len``) at which ``lengths`` reach ``density``, to
    within 1/64 of the range searched (two grids of 32 caps, one inside the other)."""
    got = core.ext.balance_cap(lengths, density, int(seq_len)) if core.ext is not None else None
    if got is not None:  # the compiled twin (pipeline/_layout.c)
        return int(got)
    lo, hi = 1, int(seq_len)
    if _density(lengths, hi) <= density:
        return hi
    x = lengths[lengths > 0].astype(np.int64)[:, None]
    total = float(x.sum())
    for _ in range(2):
        caps = np.unique(np.linspace(lo, hi, 32).astype(np.int64))
        n = -(-x // caps[None, :])
        base, extra = x // n, x % n
        dens = (extra * (base + 1) ** 2 + (n - extra) * base ** 2).sum(0) / total
        i = int(np.searchsorted(dens >= density, True))  # density grows with the cap
        if i == len(caps):
            return hi
        lo, hi = int(caps[max(i - 1, 0)]), int(caps[i])
        if hi - lo <= 1:
            break
    return hi


def lay_out(lengths: Sequence[int], seq_len: int, target: float, in_row_order: bool = False) -> dict[str, np.ndarray]:
    """Rows of ``seq_len`` tokens from pieces ``lengths`` (in order): parts ``row``,
    ``piece``, ``offset``, ``length`` (int64 arrays, by row, in each row's order); every token
    of every piece lands in exactly one part, and every row is full but the last (when the
    tokens do not fill it).

    The pieces are cut at the smallest cap at which they reach the target's density (near-equal
    parts; none cut when they cannot reach it, and none longer than ``piece_cap``), then the
    parts of at least ``SMALL`` target densities are dealt longest first, each to the row with
    room for it whose cost, with its room filled at the density of the parts still to come,
    would be lowest; the shorter parts then fill the rooms (``_fill``). A row's parts are in
    reading order, except that parts cut before their piece's end come last.

    With ``in_row_order`` each piece's parts take its tokens in the order of the rows (the
    offsets renumbered: an earlier row holds a document's earlier tokens), and the rows' parts
    are ordered again by the new offsets (``_in_row_order``); the lengths are unchanged."""
    T = int(seq_len)
    lengths = np.ascontiguousarray(lengths, np.int64)
    total = int(lengths.sum())
    if total == 0:
        return {k: np.zeros(0, np.int64) for k in ("row", "piece", "offset", "length")}
    cap = _cap_for(lengths, target / T, piece_cap(target, T))
    small, alone = SMALL * target / T, ALONE * target / T
    got = core.ext.balance_layout(lengths, cap, T, small, alone, ROUND, in_row_order) if core.ext is not None else None
    if got is None:
        lay = _deal_numpy(lengths, cap, T, small, alone)
        return _in_row_order(lay, lengths) if in_row_order else lay
    row, piece, offset, length = np.frombuffer(got, np.int64).reshape(4, -1)
    return {"row": row, "piece": piece, "offset": offset, "length": length}


def _in_row_order(lay: dict[str, np.ndarray], lengths: np.ndarray) -> dict[str, np.ndarray]:
    """``lay``'s parts with each piece's offsets renumbered in the order of the parts (by row),
    then ordered again: by row, the parts cut before their piece's end last, piece, offset."""
    row, piece, length = lay["row"], lay["piece"], lay["length"]
    order = np.lexsort((np.arange(len(row)), piece))
    within = np.empty(len(row), np.int64)
    run = np.cumsum(length[order]) - length[order]
    first = np.r_[0, np.flatnonzero(np.diff(piece[order])) + 1]
    starts_of = np.repeat(run[first], np.diff(np.r_[first, len(order)]))
    within[order] = run - starts_of
    # in each row, the parts cut before their piece's end last (the last one keeps its label)
    cut = within + length < lengths[piece]
    again = np.lexsort((within, piece, cut, row))
    return {"row": row[again], "piece": piece[again], "offset": within[again], "length": length[again]}


def _deal_numpy(lengths: np.ndarray, cap: int, T: int, small_len: float, alone_len: float) -> dict[str, np.ndarray]:
    """``lay_out``'s parts once its cap is chosen, on numpy: the reference the compiled core's
    ``balance_layout`` (``pipeline/_layout.c``) matches bit for bit."""
    total = int(lengths.sum())
    nrows = -(-total // T)
    n = np.where(lengths > cap, -(-lengths // cap), 1)
    piece = np.repeat(np.arange(len(lengths)), n)
    k = np.arange(len(piece)) - np.repeat(np.cumsum(n) - n, n)
    base, extra = np.repeat(lengths // n, n), np.repeat(lengths % n, n)
    size = base + (k < extra)
    offset = k * base + np.minimum(k, extra)
    keep = size > 0
    piece, offset, size = piece[keep], offset[keep], size[keep]
    order = np.lexsort((piece, -size))  # longest first, reading order among equals
    room = np.full(nrows, T, np.int64)
    room[-1] = total - (nrows - 1) * T
    cost = np.zeros(nrows)
    big = float(1 << 62)
    # the density of the parts after each one (longest first): what a row's room will hold
    sizes = size[order].astype(np.float64)
    later_sq = np.concatenate([np.cumsum((sizes * sizes)[::-1])[::-1][1:], [0.0]])
    later = np.concatenate([np.cumsum(sizes[::-1])[::-1][1:], [0.0]])
    rest = np.where(later > 0, later_sq / np.maximum(later, 1.0), 0.0)
    split = int(np.searchsorted(-sizes, -small_len, side="right"))
    out: list[tuple[int, int, int, int]] = []

    def deal(j: int, u: int) -> None:  # one part to the row of least projected cost
        p, off, left = int(piece[u]), int(offset[u]), int(size[u])
        while left > 0:
            fits = room >= left
            if fits.any():
                score = cost + room * rest[j]
                score[~fits] = big
                r = int(score.argmin())
                take = left
            else:  # fill the room whose row it costs least to fill with it, and deal the rest on
                score = cost + room.astype(np.float64) ** 2
                score[room == 0] = big
                r = int(score.argmin())
                take = int(room[r])
            out.append((r, p, off, take))
            cost[r] += float(take) * take
            room[r] -= take
            off += take
            left -= take

    j = 0
    alone = min(split, nrows, int(np.searchsorted(-sizes, -alone_len, side="right")))
    for u in order[:alone].tolist():  # the longest, one by one
        deal(j, u)
        j += 1
    rounds = []
    while j < split:  # then a round at a time: the next parts to the rows of least projected cost
        free = np.flatnonzero(room > 0)
        k = min(split - j, max(1, int(len(free) * ROUND)))
        chunk = order[j : j + k]
        rows = free[np.argsort(cost[free] + room[free] * rest[j + k - 1], kind="stable")[:k]]
        fit = room[rows] >= size[chunk]
        rows, units = rows[fit], chunk[fit]
        cost[rows] += size[units].astype(np.float64) ** 2
        room[rows] -= size[units]
        rounds.append((rows, piece[units], offset[units], size[units]))
        for u in chunk[~fit].tolist():
            deal(j + k - 1, u)
        j += k
    small = order[split:]
    filled = _fill(cost, room, piece[small], offset[small], size[small])
    dealt = np.array(out, np.int64).reshape(-1, 4).T
    row, piece, offset, length = (np.concatenate([d, *r, f]).astype(np.int64)
                                  for d, r, f in zip(dealt, zip(*rounds) if rounds else ([],) * 4, filled))
    cut = offset + length < lengths[piece]
    order = np.lexsort((offset, piece, cut, row))
    return {"row": row[order], "piece": piece[order], "offset": offset[order], "length": length[order]}


def _fill(cost, room, piece, offset, size) -> tuple[np.ndarray, ...]:
    """Short parts (longest first) into the rooms left, as ``(row, piece, offset, length)``
    arrays: the rooms ordered by the density they need to reach the rows' common final cost
    (highest first) take consecutive runs of the parts, so the rows that need the most get
    the longest; a part is cut where a room ends."""
    if not len(size):
        return tuple(np.zeros(0, np.int64) for _ in range(4))
    sizes = size.astype(np.float64)
    final = (cost.sum() + float((sizes * sizes).sum())) / len(cost)
    open_ = np.flatnonzero(room > 0)
    need = (final - cost[open_]) / room[open_]
    rows = open_[np.argsort(-need, kind="stable")]
    bounds = np.cumsum(room[rows])
    ends = np.cumsum(size)
    starts = ends - size
    # cut the parts' run at every room boundary inside a part
    edges = np.union1d(starts, bounds[bounds < ends[-1]])
    stops = np.append(edges[1:], ends[-1])
    unit = np.searchsorted(starts, edges, side="right") - 1
    which = np.searchsorted(bounds, edges, side="right")
    return (rows[which].astype(np.int64), piece[unit].astype(np.int64),
            (offset[unit] + edges - starts[unit]).astype(np.int64), (stops - edges).astype(np.int64))
