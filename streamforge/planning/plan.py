"""The shard plan: which record ranges each global worker reads in a pass.

A pure function of (shard sizes, seed, stream key, pass, number of global workers); no I/O.

Algorithm, per stream and pass:
  1. permute the shards with a key derived from (seed, stream, pass);
  2. lay their records end to end in that order;
  3. cut the sequence at the token quantiles ``k * num_tokens / N`` (k = 1..N-1), at the
     record boundary nearest each: exactly, from the record lengths of the shard the cut falls
     in (one record index per cut, read by the planner), or, without them, estimating
     positions inside the shard by spreading its tokens evenly over its records; global
     worker k reads the records between cuts k and k+1.

Every record lands in exactly one worker's ranges (the cuts are monotone), workers differ in
tokens by about one record (plus the estimation error when cuts are estimated), and a stream
with fewer shards than workers is split into record ranges. The global worker of (rank, worker) is
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

from .layout import Layout, Range, RecordEnds


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
    record_ends: RecordEnds | None = None,
) -> list[list[Range]]:
    """Record ranges of one stream for every global worker (or for ``workers`` only, in that
    order), in reading order.

    With ``record_tokens(shard)`` (the token count of each of a shard's records) or
    ``record_ends(shards)`` (for each shard, their running sums), a cut that falls inside a shard
    goes to the record boundary nearest its token quantile, exactly; without, the shard's
    tokens are taken as spread evenly over its records. Each cut is computed on its own (a
    worker's ranges need its two cuts only, so at most two shards' record lengths); the cuts
    are monotone either way. All the cuts wanted are computed at once (``layout.Layout``).
    """
    layout = Layout(shard_records, shard_tokens, seed, stream_key, pass_idx, num_global_workers)
    if record_ends is None and record_tokens is not None:
        record_ends = lambda shards: [_running(record_tokens(s)) for s in shards]  # noqa: E731
    return layout.ranges(workers, record_ends)


def _running(lengths) -> np.ndarray:
    """0 and the running sums of ``lengths`` (int64)."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))])


def cut_shards(shard_records, shard_tokens, *, seed: int, stream_key: str, pass_idx: int,
               num_global_workers: int, workers: Sequence[int] | None = None) -> set[int]:
    """The shards that the cuts of ``workers`` (default: all) fall inside: the ones whose
    record lengths ``plan_stream(record_tokens=...)`` asks for."""
    layout = Layout(shard_records, shard_tokens, seed, stream_key, pass_idx, num_global_workers)
    ks = range(1, layout.n) if workers is None else {k for g in workers for k in (g, g + 1)}
    return layout.cut_shards(ks)


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

RangeTotals = Callable[[int, Sequence[Range]], tuple[int, int]]
"""``totals(stream, ranges) -> (tokens, non-empty documents)`` of record ranges, summed."""


class PassClock:
    """The job clock of a pass (for a plan with ``steps``, ``workers_per_rank`` and
    ``first_step``): which of every rank's batches a worker builds, and their global steps."""

    steps: int
    workers_per_rank: int
    first_step: int

    def batches_of(self, worker: int) -> int:
        """Batches worker ``worker`` (of every rank) builds in this pass."""
        return -(-(self.steps - worker) // self.workers_per_rank) if self.steps > worker else 0

    def step_of(self, worker: int, batch_idx: int) -> int:
        """The global step of worker ``worker``'s ``batch_idx``-th batch of this pass."""
        return self.first_step + batch_idx * self.workers_per_rank + worker


@dataclass
class PassPlan(PassClock):
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
    totals: RangeTotals,
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
            t, d = totals(s, per_worker[g])
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
