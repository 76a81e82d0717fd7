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
  rest of its ranges (``docs/design.md`` bounds what that drops);
* with a batch-size or seq_len schedule (``steps.py``) the batches differ by step: a worker's
  steps each cost their rows, or their tokens where the row length changes, and the pass has
  the most steps whose costs every worker's capacity covers (``steps_for``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .last_step import padded_bound, padded_dropped
from .layout import Layout, Range, RecordEnds
from .steps import StepSchedule, batches_within, largest_batch_tokens, per_token, step_costs, tokens_in_steps


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
    fraction: float = 1.0,
) -> list[list[Range]]:
    """Record ranges of one stream for every global worker (or for ``workers`` only, in that
    order), in reading order.

    With ``record_tokens(shard)`` (the token count of each of a shard's records) or
    ``record_ends(shards)`` (for each shard, their running sums), a cut that falls inside a shard
    goes to the record boundary nearest its token quantile, exactly; without, the shard's
    tokens are taken as spread evenly over its records. Each cut is computed on its own (a
    worker's ranges need its two cuts only, so at most two shards' record lengths); the cuts
    are monotone either way. All the cuts wanted are computed at once (``layout.Layout``).
    ``fraction`` < 1 plans only the first that fraction of the pass's order, in tokens (the
    last cut at the record boundary nearest it): a partial reading of a repeated stream
    (``readings.py``).
    """
    layout = Layout(shard_records, shard_tokens, seed, stream_key, pass_idx, num_global_workers, fraction)
    if record_ends is None and record_tokens is not None:
        record_ends = lambda shards: [_running(record_tokens(s)) for s in shards]  # noqa: E731
    return layout.ranges(workers, record_ends)


def _running(lengths) -> np.ndarray:
    """0 and the running sums of ``lengths`` (int64)."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))])


def cut_shards(shard_records, shard_tokens, *, seed: int, stream_key: str, pass_idx: int,
               num_global_workers: int, workers: Sequence[int] | None = None, fraction: float = 1.0) -> set[int]:
    """The shards that the cuts of ``workers`` (default: all) fall inside: the ones whose
    record lengths ``plan_stream(record_tokens=...)`` asks for."""
    layout = Layout(shard_records, shard_tokens, seed, stream_key, pass_idx, num_global_workers, fraction)
    last = layout.n if fraction < 1 else layout.n - 1  # a partial pass also cuts at its end
    ks = range(1, last + 1) if workers is None else {k for g in workers for k in (g, g + 1)}
    return layout.cut_shards(ks)


def records_at(ranges: list[Range], fraction: float) -> int:
    """The record count ``fraction`` of the way into ``ranges`` (statistical resume)."""
    return int(round(min(max(fraction, 0.0), 1.0) * sum(b - a for _, a, b in ranges)))


def trim_ranges(ranges: list[Range], records: int) -> list[Range]:
    """``ranges`` without their first ``records`` records (the work left after a cursor)."""
    out: list[Range] = []
    cut, skipped = getattr(ranges, "cut", None), records > 0
    for shard, start, stop in ranges:
        drop = min(records, stop - start)
        records -= drop
        if start + drop < stop:
            out.append((shard, start + drop, stop))
    if cut is None:
        return out
    from .token_cuts import cut_ranges  # token cuts: the first record's head goes with it
    return cut_ranges(out, (0 if skipped else cut[0], cut[1] if out else 0))


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
    # batch-size and sequence-length schedules (``steps.StepSchedule.describe``), where either
    # changes with the step: ``batch_size`` and ``seq_len`` are then their values at
    # ``first_step``, and ``rows`` counts tokens where the row length changes (``steps.per_token``)
    shape: dict[str, Any] | None = None
    # ``[g][s]``: global worker ``g``'s tokens of stream ``s`` (EOS appended included), where
    # the plan counted them (``build_pass_plan``): what the mixture's estimate spends
    stream_tokens: list[list[int]] | None = None
    # token cuts (``token_cuts.py``): ``cuts[s][g]`` the (head, tail) of worker ``g``'s ranges
    # of stream ``s``, and per stream the tokens (with EOS) no worker was given
    cuts: list[list[list[int]]] | None = None
    unassigned: list[int] | None = None
    # "pad" (token cuts, finite): the last step takes what no full step can, its batches
    # ending in padding; each worker delivers up to its batches' tokens (``last_step.py``)
    last_step: str | None = None

    @property
    def num_global_workers(self) -> int:
        return self.world_size * self.workers_per_rank

    def rank_tokens(self, rank: int) -> int:
        w = self.workers_per_rank
        return sum(self.tokens[rank * w : (rank + 1) * w])

    def schedules(self) -> tuple[StepSchedule, StepSchedule]:
        """The (batch size, sequence length) schedules the plan was made for."""
        shape = self.shape or {}
        return (StepSchedule.build("batch_size", shape.get("batch_size", self.batch_size)),
                StepSchedule.build("seq_len", shape.get("seq_len", self.seq_len)))

    def dropped_tokens(self) -> int:
        """Tokens of the pass (all ranks) past the last step, in concat packing; for bestfit
        and pad it is a lower bound (their rows also carry padding)."""
        if self.last_step == "pad":
            return padded_dropped(self) + sum(self.unassigned or ())
        if self.shape is None:
            delivered = self.world_size * self.steps * self.batch_size * self.seq_len
        else:
            delivered = self.world_size * tokens_in_steps(*self.schedules(), self.first_step, self.steps)
        return max(0, sum(self.tokens) - delivered) + sum(self.unassigned or ())

    def rank_unassigned(self, rank: int) -> int:
        """Tokens of the pass no worker was given (token cuts), counted on rank 0's stats."""
        return sum(self.unassigned or ()) if rank == 0 else 0

    def drop_bound(self) -> int:
        """The most tokens a concat pass can drop: the spread of the workers' token counts
        plus one batch per global worker (see ``docs/design.md``); with a schedule, one of
        its largest batches per global worker and per switch inside the pass, plus one."""
        low = min(self.tokens) if self.tokens else 0
        if self.last_step == "pad" and self.cuts is not None:
            return padded_bound(self)
        if self.cuts is not None and self.shape is None:
            # token cuts: less than one global step, plus two tokens per stream and global
            # worker where the step count had to give way to them (``CutSpec.budgets``)
            return self.world_size * self.batch_size * self.seq_len + 2 * len(self.streams) * self.num_global_workers
        per_batch, switches = self.batch_size * self.seq_len, 0
        if self.shape is not None:
            per_batch, switches = largest_batch_tokens(*self.schedules(), self.first_step, max(self.steps, 1))
        spread = sum(t - low for t in self.tokens) + sum(self.unassigned or ())  # (an elastic rest of a token-cut pass)
        return spread + self.num_global_workers * per_batch * (1 + switches)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ranges"] = [[[list(r) for r in worker] for worker in stream] for stream in self.ranges]
        for key in ("cuts", "unassigned", "last_step"):
            if out[key] is None:
                out.pop(key)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PassPlan":
        data = dict(data)
        data["ranges"] = [[[tuple(r) for r in worker] for worker in stream] for stream in data["ranges"]]
        if data.get("cuts") is not None:
            from .token_cuts import cut_ranges
            data["ranges"] = [[cut_ranges(r, c) for r, c in zip(stream, cuts)]
                              for stream, cuts in zip(data["ranges"], data["cuts"])]
        return cls(**data)


def worker_rows(tokens: int, docs: int, *, seq_len: int | StepSchedule, packing: str) -> int:
    """Full rows a worker can certainly pack: concat and bestfit rows hold at most
    ``seq_len`` tokens each, so at least ``tokens // seq_len`` of them are full (bestfit pads
    the rest); pad packing builds one row per document. With a row length that changes by
    step (concat, bestfit), the capacity is counted in tokens: ``tokens`` itself (a step
    then costs its ``batch_size * seq_len``; ``steps.per_token``)."""
    if packing == "pad":
        return docs
    if isinstance(seq_len, StepSchedule):
        if seq_len.constant is None:
            return tokens
        seq_len = seq_len.constant
    return tokens // seq_len


def steps_for(rows: Sequence[int], *, world_size: int, workers_per_rank: int, batch_size: int | StepSchedule,
              seq_len: int | StepSchedule = 1, packing: str = "concat", first_step: int = 0) -> int:
    """Steps every rank can fill: worker ``w`` must build ``ceil((S - w) / W)`` full batches
    out of the ``m`` its ``rows`` can fill, so ``S <= W * m + w`` for every global worker.

    With one batch size (and row length), ``m = rows // batch_size``. With schedules, worker
    ``w``'s batches are those of the steps ``first_step + w + j * W``, each costing its
    rows (or its tokens where the row length changes: ``steps.step_costs``), and ``m`` is
    how many of them, in order, fit the worker's ``rows`` (``steps.batches_within``)."""
    w_count = workers_per_rank
    batch = StepSchedule.build("batch_size", batch_size)
    seq = StepSchedule.build("seq_len", seq_len)
    costs = None
    if batch.constant is None or per_token(seq, packing):
        costs = step_costs(batch, seq, packing)
    best = None
    for g, r in enumerate(rows):
        w = g % w_count
        fit = int(r) // batch.constant if costs is None else batches_within(int(r), *costs, first_step + w, w_count)
        cap = w_count * fit + w
        best = cap if best is None else min(best, cap)
    return int(best or 0)


def plan_shape(batch: StepSchedule, seq: StepSchedule, first_step: int) -> dict[str, Any]:
    """``PassPlan``'s ``batch_size``, ``seq_len`` and ``shape`` for these schedules."""
    varies = batch.constant is None or seq.constant is None
    shape = {"batch_size": batch.describe(), "seq_len": seq.describe()} if varies else None
    return {"batch_size": batch.at(first_step), "seq_len": seq.at(first_step), "shape": shape}


def build_pass_plan(
    stream_ranges: Sequence[list[list[Range]]],
    totals: RangeTotals,
    *,
    streams: Sequence[str],
    eos_appended: Sequence[bool],
    pass_idx: int,
    world_size: int,
    workers_per_rank: int,
    batch_size: int | StepSchedule,
    seq_len: int | StepSchedule,
    packing: str,
    first_step: int = 0,
) -> PassPlan:
    """The plan of a pass from each stream's per-worker ranges and exact range counts."""
    batch_size = StepSchedule.build("batch_size", batch_size)
    seq_len = StepSchedule.build("seq_len", seq_len)
    n = world_size * workers_per_rank
    tokens, rows, per_stream = [], [], []
    for g in range(n):
        tok = docs = 0
        mine = []
        for s, per_worker in enumerate(stream_ranges):
            t, d = totals(s, per_worker[g])
            mine.append(t + (d if eos_appended[s] else 0))
            docs += d
        tok = sum(mine)
        per_stream.append(mine)
        tokens.append(tok)
        rows.append(worker_rows(tok, docs, seq_len=seq_len, packing=packing))
    steps = steps_for(rows, world_size=world_size, workers_per_rank=workers_per_rank, batch_size=batch_size,
                      seq_len=seq_len, packing=packing, first_step=first_step)
    return PassPlan(
        pass_idx=pass_idx, world_size=world_size, workers_per_rank=workers_per_rank,
        packing=packing, streams=list(streams), ranges=[list(r) for r in stream_ranges], tokens=tokens,
        rows=rows, steps=steps, first_step=first_step, stream_tokens=per_stream,
        **plan_shape(batch_size, seq_len, first_step),
    )
