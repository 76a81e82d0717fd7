"""Values set by the global step: the batch size and the sequence length.

A ``StepSchedule`` is either one value for the whole job (an int, as ever) or a list of
``(first_step, value)`` pairs, the first at step 0, steps strictly increasing, values
positive ints: ``batch_size=[(0, 2), (1000, 4), (3000, 8)]`` is a batch-size ramp,
``seq_len=[(0, 512), (2000, 2048)]`` a sequence-length warmup. Like the mixture schedule
(``schedule.py``) it is a pure function of the step, the job's clock, so every rank and
every worker evaluates it for the step of the batch it builds and a switch takes effect
exactly at its step everywhere.

The plan (``plan.py``) needs what a step costs a worker: the step's rows (``batch_size``)
in a constant row length, or its tokens (``batch_size * seq_len``) when the row length
changes in ``concat`` or ``bestfit`` packing (a row of those holds at most ``seq_len``
tokens, so a worker holding ``t`` tokens can fill steps whose tokens sum to at most ``t``),
or its rows again in ``pad`` packing (one document a row, whatever the length).
``step_costs`` gives that cost as a piecewise-constant function of the step, and
``batches_within`` how many of a worker's steps (``offset``, ``offset + W``, ...) fit a
capacity, in one walk over the schedule's segments (never a loop over steps).
"""

from __future__ import annotations

import bisect
import numbers
from typing import Any, Sequence

from ..errors import ConfigError


class StepSchedule:
    """A positive int per global step: ``at(step)``; ``describe()`` is its plain-data form
    (the int itself when constant, so a job without a schedule keeps its fingerprint)."""

    __slots__ = ("name", "starts", "values", "constant")

    def __init__(self, name: str, starts: Sequence[int], values: Sequence[int]) -> None:
        self.name = name
        self.starts = tuple(int(s) for s in starts)
        self.values = tuple(int(v) for v in values)
        # the value of every step when there is one (the hot path reads it, no bisect)
        self.constant: int | None = self.values[0] if len(self.values) == 1 else None

    @classmethod
    def build(cls, name: str, value: Any) -> StepSchedule:
        """``value`` (an int, or ``[(step, value), ...]``) validated; ``ConfigError`` naming
        the entry that is wrong."""
        if isinstance(value, StepSchedule):
            return value
        if _is_int(value):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
            return cls(name, (0,), (int(value),))
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or isinstance(value, dict):
            raise ConfigError(f"{name} must be an int or a list of (step, {name}) pairs, got {value!r}")
        starts: list[int] = []
        values: list[int] = []
        for i, entry in enumerate(value):
            try:
                step, v = entry
            except (TypeError, ValueError):
                raise ConfigError(f"{name}[{i}] must be a (step, {name}) pair, got {entry!r}") from None
            if not _is_int(step) or step < 0:
                raise ConfigError(f"{name}[{i}] has step {step!r}; steps are integers >= 0")
            if i == 0 and step != 0:
                raise ConfigError(f"{name}[0] must start at step 0, got step {step}")
            if starts and step <= starts[-1]:
                raise ConfigError(
                    f"{name}[{i}] starts at step {step}, not after {name}[{i - 1}] (step {starts[-1]}): "
                    "steps must be strictly increasing")
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name}[{i}] (step {step}) has value {v!r}; values are integers >= 1")
            starts.append(int(step))
            values.append(int(v))
        if not starts:
            raise ConfigError(f"{name} is an empty schedule: give an int or at least (0, {name})")
        return cls(name, starts, values)

    def at(self, step: int) -> int:
        """The value at global step ``step``."""
        if self.constant is not None:
            return self.constant
        return self.values[bisect.bisect_right(self.starts, step) - 1]

    @property
    def largest(self) -> int:
        return max(self.values)

    def describe(self) -> int | list[list[int]]:
        """Plain data for the loader config (and so the resume fingerprint)."""
        if self.constant is not None:
            return self.constant
        return [[s, v] for s, v in zip(self.starts, self.values)]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepSchedule) and (self.starts, self.values) == (other.starts, other.values)

    def __hash__(self) -> int:
        return hash((self.starts, self.values))

    def __repr__(self) -> str:
        return f"StepSchedule({self.name!r}, {self.describe()!r})"


def _is_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def batch_schedule(batch_size: Any, tokens_per_step: Any, seq_len: StepSchedule) -> StepSchedule:
    """The loader's batch-size schedule: ``batch_size`` as given, or derived from
    ``tokens_per_step`` (tokens per rank and step) as ``tokens_per_step // seq_len`` at
    every step; with both, they must agree at every step."""
    given = None if batch_size is None else StepSchedule.build("batch_size", batch_size)
    if tokens_per_step is None:
        if given is None:
            raise ConfigError("StreamingLoader needs batch_size= (an int or [(step, batch_size), ...]) or "
                              "tokens_per_step=")
        return given
    if not _is_int(tokens_per_step) or tokens_per_step < 1:
        raise ConfigError(f"tokens_per_step must be an integer >= 1, got {tokens_per_step!r}")
    for start, t in zip(seq_len.starts, seq_len.values):
        if tokens_per_step % t:
            raise ConfigError(f"tokens_per_step {tokens_per_step} is not a multiple of seq_len {t} (from step {start})")
    derived = StepSchedule("batch_size", seq_len.starts, [tokens_per_step // t for t in seq_len.values])
    if given is not None:
        for step in sorted(set(given.starts) | set(seq_len.starts)):
            if given.at(step) != derived.at(step):
                raise ConfigError(
                    f"batch_size {given.at(step)} at step {step} disagrees with tokens_per_step {tokens_per_step} / "
                    f"seq_len {seq_len.at(step)} = {derived.at(step)}; give one of them")
    return _merged(derived)


def _merged(schedule: StepSchedule) -> StepSchedule:
    """``schedule`` without entries that repeat the value before them."""
    starts, values = [], []
    for s, v in zip(schedule.starts, schedule.values):
        if not values or v != values[-1]:
            starts.append(s)
            values.append(v)
    return StepSchedule(schedule.name, starts, values)


def per_token(seq_len: StepSchedule, packing: str) -> bool:
    """Whether a plan counts a worker's capacity and a step's cost in tokens (a row length
    that changes, in concat or bestfit packing) rather than in rows."""
    return seq_len.constant is None and packing != "pad"


def step_costs(batch: StepSchedule, seq_len: StepSchedule, packing: str) -> tuple[list[int], list[int]]:
    """What each step costs a worker, as segments: ``(starts, costs)``, the cost from
    ``starts[k]`` until the next start (in rows, or in tokens where ``per_token``)."""
    tokens = per_token(seq_len, packing)
    starts = sorted(set(batch.starts) | (set(seq_len.starts) if tokens else set()))
    costs = [batch.at(s) * (seq_len.at(s) if tokens else 1) for s in starts]
    return starts, costs


def _segments(starts: Sequence[int], costs: Sequence[float], offset: int, stride: int):
    """``(steps, cost)`` per segment for the steps ``offset, offset + stride, ...``: how many
    of them fall in each segment from ``offset``'s on, the last segment's count ``None``
    (it never ends)."""
    k = max(0, bisect.bisect_right(starts, offset) - 1)
    step = offset
    while k + 1 < len(starts):
        n = -(-(starts[k + 1] - step) // stride) if starts[k + 1] > step else 0
        yield n, costs[k]
        step += n * stride
        k += 1
    yield None, costs[k]


def batches_within(capacity: int, starts: Sequence[int], costs: Sequence[int], offset: int, stride: int) -> int:
    """How many of the steps ``offset, offset + stride, ...`` (in order) fit ``capacity``:
    the most ``m`` whose first ``m`` costs sum to at most ``capacity``."""
    done, left = 0, int(capacity)
    for n, cost in _segments(starts, costs, offset, stride):
        if n is None or n * cost > left:
            return done + left // cost
        left -= n * cost
        done += n
    raise AssertionError("unreachable: the last segment never ends")


def progression_cost(starts: Sequence[int], costs: Sequence[float], offset: int, stride: int, count: int) -> float:
    """The summed cost of the steps ``offset, offset + stride, ...`` (``count`` of them)
    under the segments ``(starts, costs)`` of ``step_costs``."""
    total, left = 0.0, count
    for n, cost in _segments(starts, costs, offset, stride):
        n = left if n is None else min(left, n)
        total += n * cost
        left -= n
        if left <= 0:
            break
    return total


def tokens_in_steps(batch: StepSchedule, seq_len: StepSchedule, first: int, count: int) -> int:
    """Tokens of one rank's batches at steps ``first .. first + count - 1``."""
    if batch.constant is not None and seq_len.constant is not None:
        return count * batch.constant * seq_len.constant
    job = JobTokens(batch, seq_len)
    return int(job.until(first + count) - job.until(first))


def largest_batch_tokens(batch: StepSchedule, seq_len: StepSchedule, first: int, count: int) -> tuple[int, int]:
    """``(most tokens of one batch, switches)`` over the steps ``first .. first + count - 1``:
    the largest ``batch_size * seq_len`` among them, and how many times it changes there."""
    starts = sorted(set(batch.starts) | set(seq_len.starts))
    inside = [s for s in starts if first < s < first + count]
    top = max(batch.at(s) * seq_len.at(s) for s in [first, *inside])
    return top, len(inside)


def step_at_tokens(batch: StepSchedule, seq_len: StepSchedule, tokens: float) -> int:
    """The step by which one rank's batches have held ``tokens`` tokens (rounded to the
    nearest step): the inverse of ``tokens_in_steps`` from step 0."""
    return int(round(JobTokens(batch, seq_len).step_at(tokens)))


class JobTokens:
    """Tokens the whole job's steps hold (every rank): ``until(step)`` over the steps before
    ``step`` (a fractional step counts its part) and ``step_at(tokens)``, its inverse. Both
    are piecewise linear in the step, one piece per schedule segment."""

    def __init__(self, batch: StepSchedule, seq_len: StepSchedule, ranks: int = 1) -> None:
        self.starts = sorted(set(batch.starts) | set(seq_len.starts))
        self.per = [ranks * batch.at(s) * seq_len.at(s) for s in self.starts]
        self.cum = [0]
        for k in range(len(self.starts) - 1):
            self.cum.append(self.cum[-1] + (self.starts[k + 1] - self.starts[k]) * self.per[k])

    def until(self, step: float) -> float:
        k = max(0, bisect.bisect_right(self.starts, step) - 1)
        return self.cum[k] + (step - self.starts[k]) * self.per[k]

    def step_at(self, tokens: float) -> float:
        k = max(0, bisect.bisect_right(self.cum, tokens) - 1)
        return self.starts[k] + (tokens - self.cum[k]) / self.per[k]
