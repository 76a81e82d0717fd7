"""Live membership: the plan of a pass whose data-parallel participants come and go.

A *membership history* lists, by global step, how many participants are live:
``[(0, 2), (6, 1), (18, 2)]`` (or the participants themselves, ``[(0, {0, 1}), (6, {0}),
(18, {0, 1})]``; only their number and each one's position among them matter). Every
participant computes the same plan of the pass from it, with no message between them:

* a *segment* runs from one change to the next; in it the ``n`` live participants are the
  data-parallel ranks ``0..n-1`` (a participant's position among the live ones);
* the first segment of a pass is the ordinary plan of the pass over ``n`` ranks; each later
  one is an elastic re-plan (``elastic.py``: ``work_left``, ``remaining_plan``) of what the
  previous segment's ranks had not handed out at the change step, over the new ``n`` ranks,
  its steps starting at that step: the departed participant's unconsumed work (its ranges,
  shuffle windows' rests and packer carry) goes to the survivors, a joining one takes a share
  of what is left. Every token of the pass comes once, on one step clock.

The cursors every rank of a segment had at a change step are a deterministic function of the
segment's plan and the record lengths in the shard indexes, so anyone can compute them:
``replay`` runs the segment's pipelines over a ``LengthSource``, which serves each record as
zeros of its length from the shard's index (no token, no data frame is read). That is what
lets a participant that (re)joins build its loader from the step and the history alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import ConfigError
from ..format.reader import DocBatch
from ..loader.clock import PassRest
from ..planning.plan import PassPlan
from ..source.shard_source import ShardSource
from ..topology import Topology
from .elastic import remaining_plan, work_left

Entry = tuple[int, int]  # (first step, live participants)


def check_history(history: Iterable[Any]) -> list[Entry]:
    """``history`` as ``[(step, n), ...]``: steps from 0 strictly increasing, ``n >= 1``; an
    entry may give the participants (a collection) instead of their number."""
    out: list[Entry] = []
    for item in history:
        try:
            step, members = item
        except (TypeError, ValueError):
            raise ConfigError(f"history: {item!r} is not a (step, participants) pair") from None
        out.append((whole_step(step), count(members)))
    if not out:
        raise ConfigError("history: at least one (step, participants) entry is needed")
    if out[0][0] != 0:
        raise ConfigError(f"history: the first entry must be at step 0, not {out[0][0]}")
    for (a, _), (b, _) in zip(out, out[1:]):
        if b <= a:
            raise ConfigError(f"history: steps must increase strictly ({a} then {b})")
    return out


def whole_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ConfigError(f"history: a step must be an int >= 0, got {step!r}")
    return int(step)


def count(members: Any) -> int:
    """The number of live participants ``members`` gives (an int, or the participants)."""
    if isinstance(members, (int, np.integer)) and not isinstance(members, bool):
        n = int(members)
    else:
        try:
            n = len(set(members))
        except TypeError:
            raise ConfigError(f"participants must be a count or a collection, got {members!r}") from None
    if n < 1:
        raise ConfigError(f"participants: at least one must be live, got {members!r}")
    return n


def live_at(history: Sequence[Entry], step: int) -> int:
    """Participants live at ``step``."""
    return [n for s, n in history if s <= step][-1]


def with_change(history: Sequence[Entry], step: int, n: int) -> list[Entry]:
    """``history`` with ``n`` live from ``step`` on (entries at or after ``step`` replaced)."""
    out = [e for e in history if e[0] < step]
    if not out or out[-1][1] != n:
        out.append((step, n))
    return out


class LengthSource(ShardSource):
    """A ``ShardSource`` that serves each record as zeros of its length, from the shard's
    record index: a pipeline over it consumes records exactly as over the real data (no
    decision of the stages depends on token values) and reads no data frame."""

    def read(self, shard: int, start: int, stop: int) -> DocBatch:
        if stop <= start:
            return DocBatch.empty(self.dtype)
        lengths = self.index(shard).records["num_tokens"][start:stop].astype(np.int64)
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return DocBatch(np.zeros(int(offsets[-1]), self.dtype), offsets, np.full(len(lengths), shard, np.int64),
                        np.arange(start, stop, dtype=np.int64))

    def plan_reads(self, ranges) -> None:
        pass

    def extend_reads(self, ranges) -> int:
        return 0

    def fetch_now(self, ranges) -> None:
        pass


def member_dataset(dataset, rank: int, world_size: int):
    """``dataset`` as data-parallel rank ``rank`` of ``world_size`` (sharing its planner,
    manifests and record indexes)."""
    if dataset.world_size == world_size and dataset.rank == rank:
        return dataset
    other = copy.copy(dataset)
    other.topology = Topology(rank, world_size, replica=dataset.topology.replica,
                              replicas=dataset.topology.replicas, source="membership")
    return other


def length_dataset(dataset, rank: int, world_size: int):
    """``member_dataset`` whose pipelines read through ``LengthSource``s."""
    other = copy.copy(member_dataset(dataset, rank, world_size))
    base = dataset

    def open_source(stream: int) -> ShardSource:
        real = base._index_source(stream)
        source = LengthSource(real.manifest, real.fetcher, config=real.config, read_share=real.read_share)
        source.adopt_indexes(real)
        return source

    other.open_source = open_source
    return other


@dataclass
class Segment:
    """The live participants ``n`` from ``first_step``, and the plan they follow (``rest``:
    the elastic work it re-plans; None for a pass's first segment, the ordinary plan)."""

    first_step: int
    n: int
    rest: PassRest | None
    plan: PassPlan

    @property
    def end(self) -> int:
        return self.plan.first_step + self.plan.steps


class MembershipPlanner:
    """The segments of one pass under a membership history, and any rank's cursors at any step.

    Args:
        dataset: the job's ``PackedTokenDataset``.
        workers_per_rank: logical workers per participant.
        batch_sizes: the loader's batch-size schedule.
        pass_idx, first_step: the pass and its first step.
        rest: the elastic work the pass started from (a pass resumed elastically), else None.
    """

    def __init__(self, dataset, *, workers_per_rank: int, batch_sizes, pass_idx: int, first_step: int,
                 rest: PassRest | None = None) -> None:
        self.dataset = dataset
        self.W = workers_per_rank
        self.batch_sizes = batch_sizes
        self.pass_idx = pass_idx
        self.first_step = first_step
        self.rest = rest
        self._segments: dict[tuple, Segment] = {}
        # change step -> {position in the segment that ends there: its worker states at that
        # step}: the live participants' real cursors, given at the change (``set_membership(...,
        # cursors=)``); only the others are replayed. The replay gives the same states, so a
        # participant that replays them all computes the same plan.
        self.known: dict[int, dict[int, list]] = {}

    def plan_of(self, n: int, first_step: int, rest: PassRest | None) -> PassPlan:
        ds = member_dataset(self.dataset, 0, n)
        if rest is None:
            return ds.pass_plan(self.pass_idx, workers_per_rank=self.W, batch_size=self.batch_sizes,
                                first_step=first_step)
        return remaining_plan(ds, rest.work, world_size=n, workers_per_rank=self.W, batch_size=self.batch_sizes,
                              first_step=first_step)

    def segments(self, history: Sequence[Entry], step: int) -> list[Segment]:
        """The segments of the pass up to the one holding ``step`` (a change at or past the
        pass's end belongs to the next pass)."""
        seg = self._segment((), live_at(history, self.first_step), self.first_step, self.rest)
        out = [seg]
        key: tuple = ()
        for s, n in history:
            if s <= self.first_step or s > step:
                continue
            if s >= seg.end:
                break
            if n == seg.n:
                continue
            key = key + ((s, n),)
            if key not in self._segments:
                known = self.known.get(s, {})
                states = [known[r] if r in known else self.replay(seg, r, s - seg.first_step)[0]
                          for r in range(seg.n)]
                work = work_left(self.dataset, self._global_state(seg, states))
                self._segments[key] = Segment(s, n, PassRest(work=work), self.plan_of(n, s, PassRest(work=work)))
            seg = self._segments[key]
            out.append(seg)
        return out

    def _segment(self, key: tuple, n: int, first_step: int, rest: PassRest | None) -> Segment:
        if key not in self._segments:
            self._segments[key] = Segment(first_step, n, rest, self.plan_of(n, first_step, rest))
        return self._segments[key]

    def _global_state(self, seg: Segment, states: list[list[dict | None]]) -> dict[str, Any]:
        """The job state ``work_left`` reads: every rank of the segment, as saved at its end."""
        return {
            "world_size": seg.n, "workers_per_rank": self.W, "pass": self.pass_idx,
            "remaining": None if seg.rest is None else seg.rest.to_state(),
            "generation": self.dataset.resume_generation,
            "ranks": [{"rank": r, "workers": w} for r, w in enumerate(states)],
        }

    def replay(self, seg: Segment, rank: int, batches: int, tally=None) -> tuple[list[dict | None], int]:
        """Rank ``rank``'s worker states after its first ``batches`` batches of segment
        ``seg``, and the tokens they held (``tally``: a batch's count), computed over record
        lengths only (``LengthSource``)."""
        ds = length_dataset(self.dataset, rank, seg.n)
        plan = seg.plan
        batches = min(batches, plan.steps)
        states: list[dict | None] = [None] * self.W
        tokens = 0
        for w in range(self.W):
            built = max(0, (batches - w + self.W - 1) // self.W)
            if not built:
                continue
            pipeline = ds.make_pipeline(w, self.W, first_pass=self.pass_idx, quota=plan.batches_of(w),
                                        first_step=plan.first_step, plan=plan if seg.rest is not None else None)
            try:
                for _ in range(built):
                    rows = pipeline.next_batch(self.batch_sizes.at(pipeline.step))
                    if tally is not None and rows is not None:
                        tokens += tally(rows)
                states[w] = pipeline.state_dict()
            finally:
                pipeline.close()
        return states, tokens

    def position(self, history: Sequence[Entry], step: int, rank: int, tally=None):
        """(segment holding ``step``, rank ``rank``'s worker states at ``step``, tokens it
        handed out in the segment before ``step``)."""
        seg = self.segments(history, step)[-1]
        if not 0 <= rank < seg.n:
            raise ConfigError(f"participant rank {rank} is not in 0..{seg.n - 1} at step {step}")
        states, tokens = self.replay(seg, rank, step - seg.first_step, tally)
        return seg, states, tokens
