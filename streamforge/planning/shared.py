"""The plan of a pass computed together by the ranks of a job, each reading only its own part.

A plan needs every global worker's exact tokens (the step count is the least any worker can
fill), and a worker's exact tokens need the record index of each shard its two cuts fall in.
Computed alone, every rank reads the index of every shard any cut falls in: at 1,024 ranks of
8 workers over 10,000 shards, 10,000 ranged GETs on each rank, ten million in all before the
first batch. Computed together, rank ``r`` cuts only its own ``W + 1`` cuts (reading at most
one index a cut, the shards its workers read first anyway), counts its own workers' tokens and
documents, and one all-gather over the data-parallel group hands every rank everyone's cuts
and counts: a few integers a worker. Every rank then lays out every worker's ranges from the
cuts (no I/O) and builds the same ``PassPlan`` it would have built alone, bit for bit.

The gather is a collective: every rank must ask at the same point (the loader does when a pass
starts iterating, on the training thread).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .plan import Range, records_at, trim_ranges


def shared_counts(planner, share: Any, pass_idx: int, n: int, fractions=None):
    """``(per_stream ranges of every global worker, totals)`` for ``build_pass_plan``: this
    rank's cuts and counts, and the other ranks' through ``share.gather`` (see the module
    docstring). ``totals`` answers for the ranges it was handed; any other ranges it counts
    from the indexes (``planner.totals``)."""
    rank, world = share.rank, share.world_size
    per_rank = n // world
    ks = range(rank * per_rank, (rank + 1) * per_rank + 1)
    layouts, mine, own = [], [], []
    for s in range(len(planner.names)):
        layout = planner.layout(s, pass_idx, n)
        planner.prefetch_indexes(s, layout.cut_shards(ks))
        cuts = layout.cuts(ks, planner.record_ends(s))
        ranges = layout.between(cuts[:-1], cuts[1:])
        if fractions is not None:
            ranges = [trim_ranges(r, records_at(r, fractions[s])) for r in ranges]
        layouts.append(layout)
        mine.append(cuts.tolist())
        own.append(ranges)
    planner._prefetch_counts(own)
    counts = [[planner.totals(s, own[s][i]) for s in range(len(own))] for i in range(per_rank)]
    tag = [pass_idx, n, planner.seed, list(planner.names), fractions is not None]
    parts = share.gather({"tag": tag, "rank": rank, "cuts": mine, "counts": counts})
    cuts = _join(parts, tag, per_rank, n, len(layouts))
    per_stream: list[list[list[Range]]] = []
    for s, layout in enumerate(layouts):
        ranges = layout.between(cuts[s][:-1], cuts[s][1:])
        planner.keep_ranges(s, pass_idx, n, ranges)
        if fractions is not None:
            ranges = [trim_ranges(r, records_at(r, fractions[s])) for r in ranges]
        per_stream.append(ranges)
    known = {}
    for r, part in enumerate(parts):
        for i, per_stream_counts in enumerate(part["counts"]):
            for s, got in enumerate(per_stream_counts):
                known[(s, id(per_stream[s][r * per_rank + i]))] = tuple(got)

    def totals(stream: int, ranges) -> tuple[int, int]:
        got = known.get((stream, id(ranges)))
        return got if got is not None else planner.totals(stream, ranges)

    return per_stream, totals


def _join(parts: list, tag: list, per_rank: int, n: int, streams: int) -> list[np.ndarray]:
    """Every stream's ``n + 1`` cuts from the ranks' parts (each rank's last cut is the next
    rank's first: they must agree), refusing parts of another plan."""
    cuts = [np.zeros(n + 1, np.int64) for _ in range(streams)]
    for r, part in enumerate(parts):
        if part is None or part["tag"] != tag or part["rank"] != r:
            said = None if part is None else (part["rank"], part["tag"])
            raise ConfigError(
                f"the ranks disagree on the plan of pass {tag[0]}: rank {r} sent {said}, expected rank {r} "
                f"with {tag} (every rank must compute a pass's plan at the same point, from the same manifests)")
        for s in range(streams):
            got = np.asarray(part["cuts"][s], np.int64)
            lo = r * per_rank
            if r and cuts[s][lo] != got[0]:
                raise ConfigError(f"ranks {r - 1} and {r} disagree on cut {lo} of stream {s}: "
                                  f"{cuts[s][lo]} and {got[0]} (do their manifests differ?)")
            cuts[s][lo:lo + per_rank + 1] = got
    return cuts
