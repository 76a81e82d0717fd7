"""What a rank's batches held: tokens and documents per stream, per schedule phase.

Counted in the training process from the compact batches (one ``bincount`` each), over the
batches handed to the caller; batches of skipped steps are counted apart. Plain data in the
loader state, so a resumed run's counters equal the uninterrupted run's.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..pipeline.batch import RowBatch
from ..planning.schedule import MixtureSchedule
from ..stages.base import check_state

_KEYS = ("tokens", "documents", "phase_tokens", "skipped_steps", "skipped_tokens", "dropped_tokens")


class Counters:
    def __init__(self, names: Sequence[str], schedule: MixtureSchedule) -> None:
        self.names = list(names)
        self.schedule = schedule
        n = len(self.names)
        # plain Python numbers: a handful of additions per batch on the training thread, where
        # a numpy call right after an idle step costs tens of microseconds
        self._tokens: list = [0] * n
        self._documents: list = [0] * n
        self._phase_tokens: list[list] = [[0] * n for _ in schedule.starts]
        self.skipped_steps = 0
        self.skipped_tokens = 0
        self.dropped_tokens = 0

    @property
    def tokens(self) -> list[int]:
        return [int(x) for x in self._tokens]

    @property
    def documents(self) -> list[int]:
        return [int(x) for x in self._documents]

    @property
    def phase_tokens(self) -> list[list[int]]:
        return [[int(x) for x in row] for row in self._phase_tokens]

    def tally(self, rows: RowBatch) -> tuple[int, list[int], list[int]]:
        """``(tokens, tokens per stream, documents per stream)`` of a batch: the counting,
        done where the batch is prepared (off the training thread when the loader prefetches),
        so that ``add`` is a few additions."""
        n = len(self.names)
        num_tokens = int(rows.length.sum())
        starts = rows.token_start == 0
        if n == 1:  # one stream: no bincount
            return num_tokens, [num_tokens], [int(np.count_nonzero(starts))]
        tokens = np.bincount(rows.stream, weights=rows.length, minlength=n).astype(np.int64).tolist()
        return num_tokens, tokens, np.bincount(rows.stream[starts], minlength=n).tolist()

    def add(self, tally: tuple[int, list[int], list[int]], step: int) -> None:
        """Count a batch handed out at global ``step`` from its ``tally``."""
        _, tokens, documents = tally
        phase = 0 if len(self.schedule.starts) == 1 else self.schedule.phase_at(step)
        total = [a + b for a, b in zip(self._tokens, tokens)]
        docs = [a + b for a, b in zip(self._documents, documents)]
        in_phase = [a + b for a, b in zip(self._phase_tokens[phase], tokens)]
        # stored together, last: an exception raised above (a KeyboardInterrupt, say) leaves
        # the counters as they were (the loader's commit relies on it)
        self._tokens, self._documents, self._phase_tokens[phase] = total, docs, in_phase

    def skip(self, num_tokens: int) -> None:
        self.skipped_steps += 1
        self.skipped_tokens += num_tokens

    def set_tokens(self, tokens: Sequence[float]) -> None:
        """Start from these tokens per stream (documents and phases unknown: left at 0)."""
        self._tokens = list(tokens)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _KEYS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, _KEYS, "Counters")
        n = len(self.names)
        if len(state["tokens"]) != n or len(state["phase_tokens"]) != len(self.schedule.starts):
            return  # other streams or phases: the counters cannot carry over
        self._tokens = [_number(x) for x in state["tokens"]]
        self._documents = [_number(x) for x in state["documents"]]
        self._phase_tokens = [[_number(x) for x in row] for row in state["phase_tokens"]]
        for key in ("skipped_steps", "skipped_tokens", "dropped_tokens"):
            setattr(self, key, int(state[key]))

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
            })
        return {
            "step": step,
            "phase": self.schedule.phase_at(step),
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
