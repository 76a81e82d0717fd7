"""Token cuts (``token_cuts.py``) computed together by the ranks of a job, as ``shared.py``
does for record cuts: rank ``r`` locates only its own workers' ``W + 1`` cuts of each stream
(reading the record index of the shards they fall in, at most one a cut), and one all-gather
hands every rank everyone's cuts, three integers a cut (record, token offset, position). Every
rank then lays out every worker's ranges from them (no I/O): the plan it would have made alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .token_cuts import between_cuts, cut_points


def share_token_cuts(planner, share: Any, pass_idx: int, n: int) -> None:
    """Put every worker's token-cut ranges and tokens of ``pass_idx`` in ``planner``'s caches,
    each rank computing its own cuts (a collective: every rank must call it at this point)."""
    rank, world = share.rank, share.world_size
    per_rank = n // world
    ks = np.arange(rank * per_rank, (rank + 1) * per_rank + 1)
    budgets = planner.cut_budgets(n)
    layouts, mine = [], []
    for s in range(len(planner.names)):
        eos = planner.cut_eos[s]
        layout = planner.layout(s, pass_idx, n)
        ends = lambda shards, s=s, eos=eos: planner.record_ends_with_eos(s, shards, eos)  # noqa: E731
        got = cut_points(layout, planner.cut_shard_tokens(s), budgets[s], ends, eos, ks)
        layouts.append(layout)
        mine.append([a.tolist() for a in got])
    tag = [pass_idx, n, planner.seed, list(planner.names), "tokens"]
    parts = share.gather({"tag": tag, "rank": rank, "cuts": mine})
    for s, layout in enumerate(layouts):
        rec, off, pos = _join(parts, tag, per_rank, n, s)
        ranges, tokens = between_cuts(layout, rec[:-1], off[:-1], pos[:-1], rec[1:], off[1:], pos[1:])
        planner.keep_ranges(s, pass_idx, n, ranges)
        planner.keep_cut_tokens(s, pass_idx, n, tokens)


def _join(parts: list, tag: list, per_rank: int, n: int, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stream ``s``'s ``n + 1`` cuts from the ranks' parts (neighbours share a cut: they must agree)."""
    out = np.zeros((3, n + 1), np.int64)
    for r, part in enumerate(parts):
        if part is None or part["tag"] != tag or part["rank"] != r:
            said = None if part is None else (part["rank"], part["tag"])
            raise ConfigError(f"the ranks disagree on the token cuts of pass {tag[0]}: rank {r} sent {said}, "
                              f"expected rank {r} with {tag}")
        got = np.asarray(part["cuts"][s], np.int64)
        lo = r * per_rank
        if r and not (out[:, lo] == got[:, 0]).all():
            raise ConfigError(f"ranks {r - 1} and {r} disagree on token cut {lo} of stream {s} (do their manifests differ?)")
        out[:, lo:lo + per_rank + 1] = got
    return out[0], out[1], out[2]
