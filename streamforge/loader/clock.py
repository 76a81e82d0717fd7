"""The loader's clock: where a rank is in the job, as of the last batch handed out.

A rank's local batch ``batch`` of pass ``pass_idx`` has global step ``first_step + batch``,
the same number on every rank. Besides those three numbers the clock holds what the next
batches are built from: each logical worker's pipeline state as of its last batch handed
out, the tokens handed out in the pass, and, after a resume on another topology, what is
left of the pass (``PassRest``). The loader owns the clock and moves it; the checkpointer
(``resume/checkpoint.py``) reads it to save and sets it to resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PassRest:
    """What is left of a pass after a resume on another topology: ``work`` (elastic: the
    records and saved windows not yet delivered, re-planned exactly once) or ``fractions``
    (statistical: how far into its pass each stream starts). Saved as ``{"work": ...}`` or
    ``{"fractions": [...]}``."""

    work: dict[str, Any] | None = None
    fractions: list[float] | None = None

    @property
    def elastic(self) -> bool:
        return self.work is not None

    def to_state(self) -> dict[str, Any]:
        return {"work": self.work} if self.work is not None else {"fractions": self.fractions}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> PassRest | None:
        if state is None:
            return None
        return cls(work=state["work"]) if "work" in state else cls(fractions=list(state["fractions"]))


class Clock:
    """One rank's position in the job (see the module docstring).

    Args:
        num_logical: the rank's logical workers (one pipeline state each).
    """

    def __init__(self, num_logical: int) -> None:
        self.num_logical = num_logical
        self.start(0, 0)

    @property
    def step(self) -> int:
        """The global step of the next batch (the same on every rank)."""
        return self.first_step + self.batch

    def start(self, pass_idx: int, first_step: int, rest: PassRest | None = None) -> None:
        """Stand at the start of pass ``pass_idx``, whose first batch has global step
        ``first_step`` (``rest``: only part of the pass is left)."""
        self.pass_idx = pass_idx
        self.first_step = first_step
        self.batch = 0
        self.pass_tokens = 0
        self.worker_states: list[dict | None] = [None] * self.num_logical
        self.rest = rest
        self.plan: Any = None  # the pass's plan, once the loader has computed it
