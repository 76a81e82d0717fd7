"""The rest of a token-cut pass re-planned over a new topology at token positions.

``elastic.assign_work`` deals the work a saved job left (record ranges and windows' rests) to
the new workers; with ``cuts="tokens"`` this module does it so that the rest of the pass drops
about two tokens per stream and new worker (plus what a window's rest holds past a worker's
need), as the pass itself would have:

1. the rest has the most full steps ``S`` whose tokens, plus two a stream and busy worker, the work
   holds; each new worker needs its batches' tokens plus those two a stream;
2. the windows' rests (whole: they carry their shuffle state) go, largest first, to the worker
   furthest below its need;
3. what each worker still lacks is cut out of the record ranges, stream by stream in
   proportion to the streams' range tokens, at token positions inside documents
   (``token_cuts.py``'s rules: a cut on an EOS moves past it), as ``CutRanges``;
4. what is left of the ranges (less than a step of the new topology) goes to the owners of
   one more step, ``S``, which ends in padding as a pass's last step does (``last_step.py``).
"""

from __future__ import annotations

import heapq

import numpy as np

from ..planning.layout import Range
from ..planning.token_cuts import CutRanges, CutSpec


def assign_token_work(dataset, work: dict, spec: CutSpec) -> list[tuple[list, list, np.ndarray, np.ndarray]]:
    """``assign_work``'s result (per stream: ranges, windows' rests, tokens, documents per new
    global worker) with the ranges cut at token positions."""
    planner, n = dataset.planner, spec.n
    k = len(work["streams"])
    flats = [_flat(planner, i, work["streams"][i]["ranges"], dataset.eos_appended[i]) for i in range(k)]
    have = [int(f[2][-1]) for f in flats]
    units = sorted(((int(u["tokens"]), i, j) for i, sw in enumerate(work["streams"])
                    for j, u in enumerate(sw.get("windows", []))), key=lambda x: (-x[0], x[1], x[2]))
    total = sum(have) + sum(t for t, _, _ in units)
    per_batch = spec.batch_size * spec.seq_len
    steps = total // (spec.world_size * per_batch)
    while True:
        batches = spec.batches(steps)
        need = batches * per_batch + np.where(batches > 0, 2 * k, 0)
        if steps <= 0:  # less than a step left: the windows' rests to the padded step's owners
            need[spec.last_owners(0)] = per_batch
        dealt, load = _deal(units, need, n)
        lack = np.maximum(need - load, 0) if steps > 0 else np.zeros(n, np.int64)
        running = np.concatenate([[0], np.cumsum(lack)]).tolist()
        if steps <= 0 or running[-1] < sum(have):
            break
        steps -= 1
    whole = sum(have)
    # 4. what no full step takes goes to the owners of one more step, padded (``last_step.py``)
    running = (np.asarray(running, np.int64) + spec.last_shares(steps, whole - int(running[-1]))).tolist()
    out = []
    for i, (ranges, starts, cum, sizes) in enumerate(flats):
        ends = [c * have[i] // whole if whole else 0 for c in running]
        parts, tokens = _cut(ranges, starts, cum, sizes, np.asarray(ends, np.int64), dataset.eos_appended[i])
        windows = [[work["streams"][i]["windows"][j] for (s, j) in dealt[g] if s == i] for g in range(n)]
        unit_tokens = np.array([sum(int(u["tokens"]) for u in w) for w in windows], np.int64)
        unit_docs = np.array([sum(int(u["docs"]) for u in w) for w in windows], np.int64)
        out.append((parts, windows, tokens + unit_tokens, unit_docs))
    return PaddedRest(out, steps + 1 if total > 0 else 0)


class PaddedRest(list):
    """``assign_token_work``'s result, with the steps of the rest: its full steps and the
    padded last one."""

    last_step = "pad"

    def __init__(self, items, steps: int) -> None:
        super().__init__(items)
        self.steps = int(steps)


def _deal(units, need: np.ndarray, n: int) -> tuple[list[list[tuple[int, int]]], np.ndarray]:
    """Windows' rests, largest first, each to the worker furthest below its need."""
    load = np.zeros(n, np.int64)
    dealt: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    heap = [(-int(need[g]), g) for g in range(n)]
    heapq.heapify(heap)
    for tokens, i, j in units:
        gap, g = heapq.heappop(heap)
        dealt[g].append((i, j))
        load[g] += tokens
        heapq.heappush(heap, (gap + tokens, g))
    return dealt, load


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
