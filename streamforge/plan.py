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

The plan of a pass (``PassPlan``) is that assignment made explicit, with what the job clock
needs: how many full batches every global worker can certainly build from its ranges, and so
how many steps the pass has on every rank. The clock itself:

* local batch ``i`` of a rank comes from its worker ``i % W`` (round-robin), so worker ``w``
  builds the rank's batches ``w, w + W, w + 2W, ...``;
* the step of worker ``w``'s ``j``-th batch in pass ``p`` is
  ``first_step(p) + j * W + w``: the same number on every rank, a pure function of
  (pass, worker, batch index);
* a finite pass has ``steps`` steps on every rank: the largest count every worker can fill
  with full batches, so worker ``w`` builds ``ceil((steps - w) / W)`` batches and drops the
  rest of its ranges (``docs/design.md`` bounds what that drops).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

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


def records_at(ranges: list[Range], fraction: float) -> int:
    """The record count ``fraction`` of the way into ``ranges`` (statistical resume)."""
    return int(round(min(max(fraction, 0.0), 1.0) * sum(b - a for _, a, b in ranges)))


def trim_ranges(ranges: list[Range], records: int) -> list[Range]:
    """``ranges`` without their first ``records`` records (the work left after a cursor)."""
    out: list[Range] = []
    for shard, start, stop in ranges:
        drop = min(records, stop - start)
        records -= drop
        if start + drop < stop:
            out.append((shard, start + drop, stop))
    return out


# -- the plan of a pass ----------------------------------------------------------------------

RangeCounts = Callable[[int, int, int, int], tuple[int, int]]
"""``counts(stream, shard, start, stop) -> (tokens, non-empty documents)`` of a record range."""


@dataclass
class PassPlan:
    """One pass of the job: topology, each global worker's ranges, and the steps it has.

    Plain data (``to_dict``/``from_dict`` round-trip through JSON). ``ranges[s][g]`` are the
    (shard, start, stop) ranges of stream ``s`` for global worker ``g``; ``tokens[g]`` the
    tokens those ranges hold (EOS appended by the pipeline included) and ``rows[g]`` the full
    rows the worker can certainly pack from them.
    """

    pass_idx: int
    world_size: int
    workers_per_rank: int
    batch_size: int
    seq_len: int
    packing: str
    streams: list[str]
    ranges: list[list[list[Range]]]
    tokens: list[int]
    rows: list[int]
    steps: int
    first_step: int = 0
    # after an elastic resume (``elastic.py``): per stream, per global worker, the rests of
    # saved shuffle windows it emits before reading its ranges (the ``ShuffleBuffer`` prelude)
    windows: list[list[list[dict]]] | None = None

    @property
    def num_global_workers(self) -> int:
        return self.world_size * self.workers_per_rank

    def batches_of(self, worker: int) -> int:
        """Batches worker ``worker`` (of every rank) builds in this pass."""
        return -(-(self.steps - worker) // self.workers_per_rank) if self.steps > worker else 0

    def step_of(self, worker: int, batch_idx: int) -> int:
        """The global step of worker ``worker``'s ``batch_idx``-th batch of this pass."""
        return self.first_step + batch_idx * self.workers_per_rank + worker

    def rank_tokens(self, rank: int) -> int:
        w = self.workers_per_rank
        return sum(self.tokens[rank * w : (rank + 1) * w])

    def dropped_tokens(self) -> int:
        """Tokens of the pass (all ranks) past the last step, in concat packing; for bestfit
        and pad it is a lower bound (their rows also carry padding)."""
        delivered = self.world_size * self.steps * self.batch_size * self.seq_len
        return max(0, sum(self.tokens) - delivered)

    def drop_bound(self) -> int:
        """The most tokens a concat pass can drop: the spread of the workers' token counts
        plus one batch per global worker (see ``docs/design.md``)."""
        low = min(self.tokens) if self.tokens else 0
        per_batch = self.batch_size * self.seq_len
        return sum(t - low for t in self.tokens) + self.num_global_workers * per_batch

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ranges"] = [[[list(r) for r in worker] for worker in stream] for stream in self.ranges]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PassPlan":
        data = dict(data)
        data["ranges"] = [[[tuple(r) for r in worker] for worker in stream] for stream in data["ranges"]]
        return cls(**data)


def worker_rows(tokens: int, docs: int, *, seq_len: int, packing: str) -> int:
    """Full rows a worker can certainly pack: concat and bestfit rows hold at most
    ``seq_len`` tokens each, so at least ``tokens // seq_len`` of them are full (bestfit pads
    the rest); pad packing builds one row per document."""
    return docs if packing == "pad" else tokens // seq_len


def steps_for(rows: Sequence[int], *, world_size: int, workers_per_rank: int, batch_size: int) -> int:
    """Steps every rank can fill: worker ``w`` must build ``ceil((S - w) / W)`` full batches
    from its ``rows // batch_size``, so ``S <= W * batches + w`` for every global worker."""
    w_count = workers_per_rank
    best = None
    for g, r in enumerate(rows):
        cap = w_count * (int(r) // batch_size) + g % w_count
        best = cap if best is None else min(best, cap)
    return int(best or 0)


def build_pass_plan(
    stream_ranges: Sequence[list[list[Range]]],
    counts: RangeCounts,
    *,
    streams: Sequence[str],
    eos_appended: Sequence[bool],
    pass_idx: int,
    world_size: int,
    workers_per_rank: int,
    batch_size: int,
    seq_len: int,
    packing: str,
    first_step: int = 0,
) -> PassPlan:
    """The plan of a pass from each stream's per-worker ranges and exact range counts."""
    n = world_size * workers_per_rank
    tokens, rows = [], []
    for g in range(n):
        tok = docs = 0
        for s, per_worker in enumerate(stream_ranges):
            for shard, start, stop in per_worker[g]:
                t, d = counts(s, shard, start, stop)
                tok += t + (d if eos_appended[s] else 0)
                docs += d
        tokens.append(tok)
        rows.append(worker_rows(tok, docs, seq_len=seq_len, packing=packing))
    steps = steps_for(rows, world_size=world_size, workers_per_rank=workers_per_rank, batch_size=batch_size)
    return PassPlan(
        pass_idx=pass_idx, world_size=world_size, workers_per_rank=workers_per_rank,
        batch_size=batch_size, seq_len=seq_len, packing=packing, streams=list(streams),
        ranges=[list(r) for r in stream_ranges], tokens=tokens, rows=rows, steps=steps,
        first_step=first_step,
    )
