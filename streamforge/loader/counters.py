"""What a rank's batches held: tokens and documents per stream, per schedule phase.

Counted in the training process from the compact batches (one ``bincount`` each), over the
batches handed to the caller; batches of skipped steps are counted apart. Plain data in the
loader state, so a resumed run's counters equal the uninterrupted run's.
"""

from __future__ import annotations

from operator import add
from typing import Any, NamedTuple, Sequence

import numpy as np

from ..pipeline.batch import RowBatch
from ..pipeline.cost import piece_row_costs
from ..planning.schedule import MixtureSchedule
from ..stages.base import check_state

# a named tuple built from a plain tuple, without its Python-level ``__new__`` (per batch)
_new = tuple.__new__
_count_nonzero = np.count_nonzero

_KEYS = ("tokens", "documents", "phase_tokens", "skipped_steps", "skipped_tokens", "dropped_tokens")


class Totals(NamedTuple):
    """Every count at once, never changed in place: the loader replaces ``Counters.totals``
    with one store as it hands out a batch, so an exception can leave the counts only
    before or after that batch, never in between."""

    tokens: tuple = ()
    documents: tuple = ()
    phase_tokens: tuple = ()
    skipped_steps: int = 0
    skipped_tokens: int = 0
    dropped_tokens: int = 0


class Tally(NamedTuple):
    """One batch's counts, computed where the batch is prepared (off the training thread
    when the loader prefetches)."""

    num_tokens: int
    tokens: list
    documents: list
    pieces: tuple = ()  # (start, length, seq_len, rows): what ``step_cost`` needs


class Counters:
    """A rank's counts of what its batches held, per stream and per schedule phase.

    Args:
        names: the stream names, in the dataset's order.
        schedule: the mixture schedule whose phases the counts are kept by.
    """

    def __init__(self, names: Sequence[str], schedule: MixtureSchedule) -> None:
        self.names = list(names)
        self.schedule = schedule
        n = len(self.names)
        # plain Python numbers: a handful of additions per batch on the training thread, where
        # a numpy call right after an idle step costs tens of microseconds
        zeros = (0,) * n
        self.totals = Totals(zeros, zeros, tuple(zeros for _ in schedule.starts))
        self.last: Tally | None = None  # the last batch handed out (``step_cost``)
        self._single_stream = n == 1
        self._single_phase = len(schedule.starts) == 1

    @property
    def tokens(self) -> list[int]:
        return [int(x) for x in self.totals.tokens]

    @property
    def documents(self) -> list[int]:
        return [int(x) for x in self.totals.documents]

    @property
    def phase_tokens(self) -> list[list[int]]:
        return [[int(x) for x in row] for row in self.totals.phase_tokens]

    @property
    def skipped_steps(self) -> int:
        return self.totals.skipped_steps

    @property
    def skipped_tokens(self) -> int:
        return self.totals.skipped_tokens

    @property
    def dropped_tokens(self) -> int:
        return self.totals.dropped_tokens

    def tally(self, rows: RowBatch) -> Tally:
        """A batch's counts, so that ``after`` is a few additions."""
        length = rows.length
        shape = rows.tokens.shape
        num_tokens = sum(length.tolist())  # a few dozen pieces: cheaper than a numpy reduction
        pieces = (rows.start.copy(), length.copy(), shape[1] - 1, shape[0])
        if self._single_stream:  # documents begun = pieces at token 0: no bincount
            token_start = rows.token_start
            begun = len(token_start) - int(_count_nonzero(token_start))
            return _new(Tally, (num_tokens, [num_tokens], [begun], pieces))
        n = len(self.names)
        starts = rows.token_start == 0
        tokens = np.bincount(rows.stream, weights=length, minlength=n).astype(np.int64).tolist()
        return Tally(num_tokens, tokens, np.bincount(rows.stream[starts], minlength=n).tolist(), pieces)

    def after(self, tally: Tally, step: int) -> Totals:
        """The totals once a batch of ``tally`` is handed out at global ``step`` (nothing changes)."""
        t = self.totals
        if self._single_stream and self._single_phase:  # one number each: no maps, no lists
            k = tally[1][0]
            return _new(Totals, ((t[0][0] + k,), (t[1][0] + tally[2][0],), ((t[2][0][0] + k,),), t[3], t[4], t[5]))
        phase = 0 if self._single_phase else self.schedule.phase_at(step)
        rows = list(t.phase_tokens)
        rows[phase] = tuple(map(add, rows[phase], tally.tokens))
        return Totals(tuple(map(add, t.tokens, tally.tokens)), tuple(map(add, t.documents, tally.documents)),
                      tuple(rows), t.skipped_steps, t.skipped_tokens, t.dropped_tokens)

    def after_skip(self, tally: Tally) -> Totals:
        """The totals once a batch of ``tally`` is dropped at a skipped step."""
        t = self.totals
        return t._replace(skipped_steps=t.skipped_steps + 1, skipped_tokens=t.skipped_tokens + tally.num_tokens)

    def add_dropped(self, num_tokens: int) -> None:
        """Count tokens of a pass that no full step held."""
        self.totals = self.totals._replace(dropped_tokens=self.totals.dropped_tokens + num_tokens)

    def set_tokens(self, tokens: Sequence[float]) -> None:
        """Start from these tokens per stream (documents and phases unknown: left at 0)."""
        self.totals = self.totals._replace(tokens=tuple(tokens))

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        t = self.totals
        return {"tokens": list(t.tokens), "documents": list(t.documents),
                "phase_tokens": [list(row) for row in t.phase_tokens], "skipped_steps": t.skipped_steps,
                "skipped_tokens": t.skipped_tokens, "dropped_tokens": t.dropped_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, _KEYS, "Counters")
        n = len(self.names)
        if len(state["tokens"]) != n or len(state["phase_tokens"]) != len(self.schedule.starts):
            return  # other streams or phases: the counters cannot carry over
        self.totals = Totals(
            tuple(_number(x) for x in state["tokens"]), tuple(_number(x) for x in state["documents"]),
            tuple(tuple(_number(x) for x in row) for row in state["phase_tokens"]),
            int(state["skipped_steps"]), int(state["skipped_tokens"]), int(state["dropped_tokens"]),
        )

    # -- report ----------------------------------------------------------------------------
    def report(self, step: int) -> dict[str, Any]:
        phases = []
        for p, (start, weights) in enumerate(zip(self.schedule.starts, self.schedule.weights)):
            counts = self.phase_tokens[p]
            total = sum(counts)
            phases.append({
                "phase": p,
                "first_step": start,
                "weights": dict(zip(self.names, weights)),
                "tokens": dict(zip(self.names, counts)),
                "shares": {k: (c / total if total else 0.0) for k, c in zip(self.names, counts)},
                "lr_scale": self.schedule.lr_scale_of(p),
            })
        return {
            "step": step,
            "phase": self.schedule.phase_at(step),
            "lr_scale": self.schedule.lr_scale_at(step),  # of the step about to be trained
            "streams": {
                name: {"tokens": t, "documents": d}
                for name, t, d in zip(self.names, self.tokens, self.documents)
            },
            "phases": phases,
            "skipped_steps": self.skipped_steps,
            "skipped_tokens": self.skipped_tokens,
            "dropped_tokens": self.dropped_tokens,
        }


def _number(x) -> int | float:
    """A saved count: an int, or a float where a resume on another world size shared a
    total among ranks."""
    if isinstance(x, int):
        return x
    x = float(x)
    return int(x) if x.is_integer() else x


def spread(states: list[dict[str, Any]], ways: int) -> dict[str, Any]:
    """Counter states of several ranks summed, then shared evenly among ``ways`` ranks (a
    resume on another number of ranks: the job's totals carry over)."""
    out: dict[str, Any] = {}
    for key in _KEYS:
        values = [np.asarray(s[key], np.float64) for s in states]
        total = sum(values[1:], values[0]) / ways
        out[key] = total.tolist() if total.ndim else float(total)
    for key in ("skipped_tokens", "dropped_tokens"):
        out[key] = int(round(out[key]))
    out["skipped_steps"] = max(int(s["skipped_steps"]) for s in states)  # every rank skips the same steps
    return out


def storage_totals(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Workers' storage counters summed (nested dicts key by key), ratios recomputed."""
    total: dict[str, Any] = {}
    for part in parts:
        _accumulate(total, part)
    _ratios(total)
    return total


def _accumulate(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(value, dict):
            _accumulate(total.setdefault(key, {}), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value


def _ratios(total: dict[str, Any]) -> None:
    """Ratios do not add up across workers: recompute them from the summed counters."""
    for value in total.values():
        if isinstance(value, dict):
            _ratios(value)
    if "bytes_fetched" in total and "bytes_needed" in total:
        needed = total["bytes_needed"]
        total["read_amplification"] = total["bytes_fetched"] / needed if needed else 0.0


def step_cost(tally: Tally | None, step: int) -> dict[str, Any] | None:
    """The attention cost (``pipeline/cost.py``, ``sum(L ** 2)`` over the document pieces of
    each row) of the batch of ``tally``, handed out at ``step``: the batch's and its costliest
    row's; None before the first batch."""
    if tally is None or not tally.pieces:
        return None
    start, length, seq_len, rows = tally.pieces
    costs = piece_row_costs(start, length, seq_len, rows)
    return {"step": step, "cost": float(costs.sum()), "max_row": float(costs.max()) if len(costs) else 0.0,
            "rows": int(rows)}
