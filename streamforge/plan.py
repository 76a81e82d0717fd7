"""The shard plan: which record ranges each global worker reads in a pass.

A pure function of (shard sizes, seed, stream key, pass, number of global workers); no I/O.

Algorithm, per stream and pass:
  1. permute the shards with a key derived from (seed, stream, pass);
  2. lay their records end to end in that order, and estimate each record's token position
     by spreading every shard's token count evenly over its records;
  3. cut the sequence at the token quantiles ``k * num_tokens / N`` (k = 1..N-1), rounded to
     the nearest record; global worker k reads the records between cuts k and k+1.

Every record lands in exactly one worker's ranges (the cuts are monotone), workers differ in
tokens by about one record plus the within-shard estimation error, and a stream with fewer
shards than workers is split into record ranges. The global worker of (rank, worker) is
``rank * workers_per_rank + worker``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .format.manifest import Manifest
from .rng import derive_key, permutation

Range = tuple[int, int, int]  # (shard, start_record, stop_record), stop exclusive


def plan_stream(
    shard_records: Sequence[int] | np.ndarray,
    shard_tokens: Sequence[int] | np.ndarray,
    *,
    seed: int,
    stream_key: str,
    pass_idx: int,
    num_global_workers: int,
) -> list[list[Range]]:
    """Record ranges of one stream for every global worker, in reading order."""
    records = np.asarray(shard_records, dtype=np.int64)
    tokens = np.asarray(shard_tokens, dtype=np.float64)
    n_workers = int(num_global_workers)
    if n_workers < 1:
        raise ValueError(f"num_global_workers must be >= 1, got {num_global_workers}")
    order = permutation(len(records), derive_key("shard-order", seed, stream_key, pass_idx))
    rec = records[order]
    tok = tokens[order]
    rec_start = np.concatenate([[0], np.cumsum(rec)])  # position of each shard in record space
    tok_start = np.concatenate([[0.0], np.cumsum(tok)])
    total = tok_start[-1]
    cuts = [0]
    for k in range(1, n_workers):
        target = total * k / n_workers
        # the last shard whose token span starts at or before the target
        j = int(np.searchsorted(tok_start[1:], target, side="left"))
        j = min(j, len(rec) - 1)
        if tok[j] > 0:
            frac = (target - tok_start[j]) / tok[j]
            within = int(round(min(max(frac, 0.0), 1.0) * rec[j]))
        else:
            within = int(rec[j]) if target > tok_start[j] else 0
        cuts.append(max(cuts[-1], int(rec_start[j]) + within))
    cuts.append(int(rec_start[-1]))
    return [_ranges_between(order, rec, rec_start, cuts[k], cuts[k + 1]) for k in range(n_workers)]


def _ranges_between(order, rec, rec_start, lo: int, hi: int) -> list[Range]:
    """The (shard, start, stop) pieces of the record-space interval [lo, hi)."""
    out: list[Range] = []
    if hi <= lo:
        return out
    j = int(np.searchsorted(rec_start, lo, side="right")) - 1
    while j < len(rec) and rec_start[j] < hi:
        start = max(lo, int(rec_start[j])) - int(rec_start[j])
        stop = min(hi, int(rec_start[j + 1])) - int(rec_start[j])
        if stop > start:
            out.append((int(order[j]), start, stop))
        j += 1
    return out


def plan_for_manifest(
    manifest: Manifest, *, seed: int, stream_key: str, pass_idx: int, num_global_workers: int
) -> list[list[Range]]:
    return plan_stream(
        manifest.columns["num_records"],
        manifest.columns["num_tokens"],
        seed=seed,
        stream_key=stream_key,
        pass_idx=pass_idx,
        num_global_workers=num_global_workers,
    )


def range_tokens(manifest: Manifest, ranges: list[Range]) -> float:
    """Estimated tokens in ``ranges`` (each shard's tokens spread evenly over its records)."""
    recs = manifest.columns["num_records"]
    toks = manifest.columns["num_tokens"]
    return float(sum(toks[s] * (b - a) / max(recs[s], 1) for s, a, b in ranges))


def format_plan(
    urls: Sequence[str],
    *,
    world_size: int,
    workers: int,
    seed: int = 0,
    pass_idx: int = 0,
    storage_options: dict[str, Any] | None = None,
    names: Sequence[str] | None = None,
) -> str:
    """A human-readable plan: per (rank, worker), per stream, ranges, records and tokens."""
    manifests = [Manifest.load(u, storage_options) for u in urls]
    keys = list(names) if names else [f"stream{i}" for i in range(len(urls))]
    n = world_size * workers
    plans = [
        plan_for_manifest(m, seed=seed, stream_key=k, pass_idx=pass_idx, num_global_workers=n)
        for m, k in zip(manifests, keys)
    ]
    lines = [f"plan: seed={seed} pass={pass_idx} world_size={world_size} workers={workers} "
             f"({n} global workers)"]
    totals = []
    for g in range(n):
        rank, worker = divmod(g, workers)
        per_stream = []
        total = 0.0
        for m, key, plan in zip(manifests, keys, plans):
            ranges = plan[g]
            toks = range_tokens(m, ranges)
            total += toks
            recs = sum(b - a for _, a, b in ranges)
            shown = " ".join(f"{s}[{a}:{b}]" for s, a, b in ranges[:6])
            more = f" +{len(ranges) - 6} more" if len(ranges) > 6 else ""
            per_stream.append(f"    {key}: {len(ranges)} ranges, {recs} records, ~{toks:,.0f} tokens: {shown}{more}")
        totals.append(total)
        lines.append(f"rank {rank} worker {worker} (global {g}): ~{total:,.0f} tokens")
        lines.extend(per_stream)
    mean = sum(totals) / len(totals) if totals else 0.0
    if mean:
        lines.append(f"balance: max/mean tokens = {max(totals) / mean:.4f}, min/mean = {min(totals) / mean:.4f}")
    return "\n".join(lines)
