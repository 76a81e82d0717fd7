"""The rest of a token-cut pass re-planned over a new topology at token positions.

``elastic.assign_work`` deals the work a saved job left (record ranges and windows' rests) to
the new workers; with ``cuts="tokens"`` this module does it so that the rest of the pass drops
about two tokens per stream and new worker, as the pass itself would have:

1. the rest has the most full steps ``S`` whose tokens, plus two a stream and busy worker, the work
   holds; each new worker needs its batches' tokens plus those two a stream;
2. the windows' rests, one sequence of tokens (rest after rest, each rest's documents in its
   emission order), are cut into consecutive spans, worker after worker, each the worker's
   need (``_deal``): a span holds rests whole, a rest's consecutive documents as a piece of it
   (``probes.rest_piece``: ``pos`` to ``stop``) and, where a cut falls inside a document, that
   document's part as a rest of its own, read through trims as token cuts read theirs
   (``probes.doc_part``; a cut on an EOS moves past it);
3. what each worker still lacks is cut out of the record ranges, stream by stream in
   proportion to the streams' range tokens, at token positions inside documents
   (``token_cuts.py``'s rules: a cut on an EOS moves past it), as ``CutRanges``;
4. what is left (less than a step of the new topology: the rests' tokens past the needs, then
   the ranges') goes to the owners of one more step, ``S``, in about equal shares; it ends in
   padding as a pass's last step does (``last_step.py``).

Rests dealt whole (largest first, to the worker furthest below its need), as before, held
more than a worker's need where the rest of the pass was mostly windows: a pass saved at step
110 of 138 on one rank and finished on two had one padded step left and dropped 1,693 of the
1,757 tokens of its rest; it now has 14 steps and drops none.
"""

from __future__ import annotations

import numpy as np

from ..planning.layout import Range
from ..planning.token_cuts import CutRanges, CutSpec
from .probes import RestDocs, doc_part, rest_docs, rest_piece


def assign_token_work(dataset, work: dict, spec: CutSpec) -> list[tuple[list, list, np.ndarray, np.ndarray]]:
    """``assign_work``'s result (per stream: ranges, windows' rests, tokens, documents per new
    global worker) with the ranges cut at token positions."""
    planner, n = dataset.planner, spec.n
    k = len(work["streams"])
    flats = [_flat(planner, i, work["streams"][i]["ranges"], dataset.eos_appended[i]) for i in range(k)]
    have = [int(f[2][-1]) for f in flats]
    units = [(i, u) for i, sw in enumerate(work["streams"]) for u in sorted(sw.get("windows", []), key=_unit_order)]
    total = sum(have) + sum(int(u["tokens"]) for _, u in units)
    per_batch = spec.batch_size * spec.seq_len
    steps = total // (spec.world_size * per_batch)
    docs_of: dict[int, RestDocs] = {}  # the documents of the rests a cut falls inside, read once
    while True:
        batches = spec.batches(steps)
        need = batches * per_batch + np.where(batches > 0, 2 * k, 0)
        if steps <= 0:  # less than a step left: the windows' rests to the padded step's owners
            need[spec.last_owners(0)] = per_batch
        demands = [(g, int(need[g])) for g in range(n)]
        dealt, load = _deal(dataset, units, docs_of, demands, n)
        lack = np.maximum(need - load, 0) if steps > 0 else np.zeros(n, np.int64)
        if lack.sum() >= sum(have) and (lack <= np.where(batches > 0, 2 * k, 0)).all():
            lack[:] = 0  # short of the needs by cuts moved past an EOS only: the batches are full still
        running = np.concatenate([[0], np.cumsum(lack)]).tolist()
        if steps <= 0 or running[-1] < sum(have) or running[-1] == 0:  # (0: the rests fill every need)
            break
        steps -= 1
    whole = sum(have)
    # 4. what no full step takes goes to the owners of one more step, padded (``last_step.py``):
    # in equal shares, the rests' tokens past the needs first, then what is left of the ranges
    left = sum(int(u["tokens"]) for _, u in units) - int(need.sum())
    if left > 0 and steps > 0:
        shares = np.diff(spec.last_shares(steps, left + whole - int(running[-1])))
        extra = []
        for g in np.flatnonzero(shares).tolist():
            extra.append((g, min(int(shares[g]), left)))
            shares[g] -= extra[-1][1]
            left -= extra[-1][1]
        dealt, _ = _deal(dataset, units, docs_of, demands + extra, n)
        running = (np.asarray(running, np.int64) + np.concatenate([[0], np.cumsum(shares)])).tolist()
    else:
        running = (np.asarray(running, np.int64) + spec.last_shares(steps, whole - int(running[-1]))).tolist()
    out = []
    for i, (ranges, starts, cum, sizes) in enumerate(flats):
        ends = [c * have[i] // whole if whole else 0 for c in running]
        parts, tokens = _cut(ranges, starts, cum, sizes, np.asarray(ends, np.int64), dataset.eos_appended[i])
        windows = [[u for s, u in dealt[g] if s == i] for g in range(n)]
        unit_tokens = np.array([sum(int(u["tokens"]) for u in w) for w in windows], np.int64)
        unit_docs = np.array([sum(int(u["docs"]) for u in w) for w in windows], np.int64)
        out.append((parts, windows, tokens + unit_tokens, unit_docs))
    return PaddedRest(out, steps + 1 if total > 0 else 0)


def _unit_order(unit: dict) -> tuple:
    """Windows' rests in the work's order: by window, pieces of one window in emission order."""
    return unit["ranges"], int(unit["key"]), int(unit["pos"])


class PaddedRest(list):
    """``assign_token_work``'s result, with the steps of the rest: its full steps and the
    padded last one."""

    last_step = "pad"

    def __init__(self, items, steps: int) -> None:
        super().__init__(items)
        self.steps = int(steps)


def _deal(dataset, units: list, docs_of: dict, demands: list[tuple[int, int]], n: int) -> tuple[list, np.ndarray]:
    """The windows' rests ``units`` (``(stream, rest)``, in order: their tokens one sequence,
    each rest's documents in emission order) cut into consecutive spans of ``demands``
    (``(worker, tokens)``, in order; what they leave goes to the last): per worker its
    ``(stream, rest)`` pieces, and the tokens each got.

    A span is a rest whole where it holds one, else its documents ``a..b`` (``rest_piece``)
    and the parts of the documents a cut falls inside (``doc_part``: the record read through
    trims, as token cuts read theirs); a cut onto an EOS moves past it (``token_cuts.py``'s
    rule), the next span one token shorter. Only the rests a cut falls inside are read
    (``docs_of``: ``rest_docs``, kept)."""
    load = np.zeros(n, np.int64)
    dealt: list[list[tuple[int, dict]]] = [[] for _ in range(n)]
    ends = np.cumsum([t for _, t in demands]).tolist()

    def docs(j: int) -> RestDocs:
        if j not in docs_of:
            docs_of[j] = rest_docs(dataset, *units[j])
        return docs_of[j]

    at, d = 0, 0  # tokens dealt so far, the demand being met
    for j, (i, unit) in enumerate(units):
        size, x = int(unit["tokens"]), 0
        while x < size:
            while d < len(demands) - 1 and ends[d] <= at:
                d += 1
            g = demands[d][0]
            y = size if d == len(demands) - 1 else min(size, x + ends[d] - at)
            if y < size:
                rest = docs(j)
                cum = np.concatenate([[0], np.cumsum(rest.tokens)])
                e = int(np.searchsorted(cum, y, side="right")) - 1
                if y > cum[e] and rest.eos[e] and y == cum[e + 1] - 1:  # onto an EOS: past it
                    y += 1
            dealt[g] += [(i, u) for u in _span(unit, docs, j, x, y, size)]
            load[g] += y - x
            at += y - x
            x = y
    return dealt, load


def _span(unit: dict, docs, j: int, x: int, y: int, size: int) -> list[dict]:
    """Tokens ``x..y-1`` of window's rest ``units[j]`` (``size`` tokens) as rests."""
    if x == 0 and y == size:
        return [dict(unit)]
    rest = docs(j)
    cum = np.concatenate([[0], np.cumsum(rest.tokens)]).tolist()
    out = []
    a = int(np.searchsorted(cum, x, side="right")) - 1
    if x > cum[a]:  # inside a document: its part up to y or its end
        stop = min(y, cum[a + 1])
        out.append(doc_part(rest, a, x - cum[a], stop - cum[a]))
        x, a = stop, a + 1
    if x < y:
        b = int(np.searchsorted(cum, y, side="right")) - 1
        if b > a:
            out.append(rest_piece(unit, rest.tokens, a, b))
        if y > cum[b]:
            out.append(doc_part(rest, b, 0, y - cum[b]))
    return out


def _flat(planner, stream: int, ranges, eos: bool):
    """A stream's work ranges in order: the ranges, each one's first record in the flat order,
    the running sums of the records' tokens (with EOS), and the records' sizes."""
    ranges = [tuple(int(x) for x in r) for r in ranges]
    planner.prefetch_indexes(stream, {r[0] for r in ranges})
    sizes = []
    for shard, a, b in ranges:
        tokens, docs = planner._prefix_of(stream, shard)
        sizes.append(np.diff(tokens[a:b + 1]) + (np.diff(docs[a:b + 1]) if eos else 0))
    sizes = np.concatenate(sizes).astype(np.int64) if sizes else np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.cumsum([b - a for _, a, b in ranges])]).astype(np.int64)
    return ranges, starts, np.concatenate([[0], np.cumsum(sizes)]), sizes


def _cut(ranges, starts, cum, sizes, ends: np.ndarray, eos: bool) -> tuple[list, np.ndarray]:
    """The flat token sequence cut at ``ends``: each worker's ``CutRanges`` and tokens."""
    total = int(cum[-1])
    pos = np.minimum(ends, total)
    rec = np.searchsorted(cum, pos, side="right") - 1
    rec = np.minimum(rec, len(sizes))
    off = pos - cum[rec]
    inside = (pos < total) & (off > 0)
    onto_eos = inside & eos & (off == sizes[np.minimum(rec, max(len(sizes) - 1, 0))] - 1) if len(sizes) else inside
    rec = np.where(onto_eos, rec + 1, rec)
    off = np.where(onto_eos | ~inside, 0, off)
    pos = pos + onto_eos
    parts, tokens = [], np.zeros(len(ends) - 1, np.int64)
    for g in range(len(ends) - 1):
        if pos[g + 1] <= pos[g]:
            parts.append(CutRanges())
            continue
        lo, hi = int(rec[g]), int(rec[g + 1]) + (1 if off[g + 1] > 0 else 0)
        piece = CutRanges(_records(ranges, starts, lo, hi))
        piece.cut = (int(off[g]), int(off[g + 1]))
        parts.append(piece)
        tokens[g] = pos[g + 1] - pos[g]
    return parts, tokens


def _records(ranges, starts: np.ndarray, lo: int, hi: int) -> list[Range]:
    """Flat records ``lo..hi-1`` as ``(shard, start, stop)`` ranges."""
    out: list[Range] = []
    j = int(np.searchsorted(starts, lo, side="right")) - 1
    while lo < hi and j < len(ranges):
        shard, a, b = ranges[j]
        take = min(hi, int(starts[j + 1])) - lo
        first = a + lo - int(starts[j])
        if take > 0:
            out.append((shard, first, first + take))
        lo += take
        j += 1
    return out
