"""What changes with the global step: the mixture schedule and the skip ranges.

Both are pure functions of the step, the job's one clock (see ``plan.py`` for how a batch's
step is derived from (pass, worker, batch index)). Every rank and every worker evaluates them
for the step of the batch it is building, so a phase switch or a skip takes effect exactly
at its step everywhere, with no communication.

Weights are token shares. A schedule is a list of phases ``(first_step, {stream: weight})``
starting at step 0 with increasing steps; a stream missing from a phase keeps its base
weight (``Stream.weight``). ``temperature`` reshapes every phase: ``w ** (1 / temperature)``,
renormalized; above 1 flattens the mixture, below 1 sharpens it.

A phase may also carry an LR scale, as ``(first_step, {stream: weight}, lr_scale)`` or
``Phase(first_step, weights, lr_scale)``: the factor the trainer applies to its scheduler's
learning rate during the phase (``StreamingLoader.lr_scale``). ``anneal=(step, {stream:
weight}[, lr_scale])`` is the shortcut for "switch for the last steps": phase 0 keeps the
base weights, and from ``step`` the streams it lists get its weights and every other stream 0.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import ConfigError


@dataclass(frozen=True)
class Phase:
    """One phase of a mixture schedule: from global step ``step``, the streams' ``weights``
    (a stream left out keeps its base weight) and the learning-rate factor ``lr_scale``."""

    step: int
    weights: Mapping[str, float]
    lr_scale: float = 1.0


@dataclass(frozen=True)
class MixtureSchedule:
    """Normalized stream weights per phase; ``weights_at(step)`` is what the interleaver uses,
    ``lr_scale_at(step)`` the factor of the trainer's learning rate."""

    names: tuple[str, ...]
    starts: tuple[int, ...]  # first step of each phase, increasing, starting at 0
    weights: tuple[tuple[float, ...], ...]  # per phase, one normalized share per stream
    temperature: float = 1.0
    lr_scales: tuple[float, ...] = ()  # per phase (empty: 1.0 everywhere)

    @classmethod
    def build(
        cls,
        names: Sequence[str],
        base: Sequence[float],
        phases: Any = None,
        temperature: float = 1.0,
        anneal: Any = None,
    ) -> "MixtureSchedule":
        """Validate ``phases`` (None, a {name: weight} mapping, or a list of ``(step,
        mapping)``, ``(step, mapping, lr_scale)`` or ``Phase``) and ``anneal`` against the
        stream ``names``; raise ``ConfigError`` naming the phase and stream."""
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ConfigError(f"temperature must be a finite number > 0, got {temperature!r}")
        if anneal is not None:
            if phases is not None and not isinstance(phases, Mapping):
                raise ConfigError("anneal: the shortcut compiles into phases; give either anneal= or a list of "
                                  "phases in weights=, not both")
            phases = _anneal_phases(anneal, names, phases)
        elif phases is None:
            phases = [(0, {})]
        elif isinstance(phases, Mapping):
            phases = [(0, phases)]
        elif isinstance(phases, (str, bytes)) or not isinstance(phases, Sequence):
            raise ConfigError(f"weights must be a {{stream: weight}} mapping or a list of phases, got {phases!r}")
        starts, weights, scales = [], [], []
        for i, phase in enumerate(phases):
            start, mapping, scale = _unpack_phase(i, phase)
            if i == 0 and start != 0:
                raise ConfigError(f"weights: phase 0 must start at step 0, got step {start}")
            if starts and start <= starts[-1]:
                raise ConfigError(
                    f"weights: phase {i} starts at step {start}, not after phase {i - 1} (step {starts[-1]})"
                )
            row = _phase_weights(i, start, mapping, names, base)
            starts.append(start)
            weights.append(_temper(row, float(temperature)))
            scales.append(scale)
        lr_scales = tuple(scales) if any(x != 1.0 for x in scales) else ()
        return cls(tuple(names), tuple(starts), tuple(weights), float(temperature), lr_scales)

    def phase_at(self, step: int) -> int:
        return bisect.bisect_right(self.starts, step) - 1

    def weights_at(self, step: int) -> tuple[float, ...]:
        return self.weights[self.phase_at(step)]

    def lr_scale_of(self, phase: int) -> float:
        return self.lr_scales[phase] if self.lr_scales else 1.0

    def lr_scale_at(self, step: int) -> float:
        """The learning-rate factor of the phase ``step`` is in."""
        return self.lr_scale_of(self.phase_at(step)) if self.lr_scales else 1.0

    def describe(self) -> dict[str, Any]:
        """Plain data for the loader config (and so the resume fingerprint); a phase's
        ``lr_scale`` appears where it is not 1, so a schedule without one describes itself
        as before."""
        phases = []
        for p, (s, w) in enumerate(zip(self.starts, self.weights)):
            entry: dict[str, Any] = {"step": s, "weights": dict(zip(self.names, w))}
            if self.lr_scale_of(p) != 1.0:
                entry["lr_scale"] = self.lr_scale_of(p)
            phases.append(entry)
        return {"temperature": self.temperature, "phases": phases}


def _unpack_phase(i: int, phase: Any) -> tuple[int, Mapping, float]:
    if isinstance(phase, Phase):
        start, mapping, scale = phase.step, phase.weights, phase.lr_scale
    else:
        try:
            start, mapping, *rest = phase
        except (TypeError, ValueError):
            rest = [None, None]
        if isinstance(phase, (str, bytes, Mapping)) or len(rest) > 1:
            raise ConfigError(f"weights: phase {i} must be (step, {{stream: weight}}) or (step, {{stream: weight}}, "
                              f"lr_scale) or a Phase, got {phase!r}")
        scale = rest[0] if rest else 1.0
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ConfigError(f"weights: phase {i} has step {start!r}; steps are integers >= 0")
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"weights: phase {i} (step {start}) needs a {{stream: weight}} mapping, got {mapping!r}")
    return int(start), mapping, _lr_scale(f"weights: phase {i} (step {start})", scale)


def _lr_scale(where: str, scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ConfigError(f"{where}: lr_scale must be a finite number > 0, got {scale!r}")
    return float(scale)


def _anneal_phases(anneal: Any, names: Sequence[str], base: Mapping | None) -> list[tuple[int, Mapping, float]]:
    """The phases ``anneal=(step, {stream: weight}[, lr_scale])`` stands for: phase 0 with the
    base weights (``base``, a mapping given as ``weights=``, if any), then from ``step`` the
    listed weights, every stream not listed at 0."""
    try:
        start, mapping, *rest = anneal
    except (TypeError, ValueError):
        rest = [None, None]
    if isinstance(anneal, (str, bytes, Mapping)) or len(rest) > 1:
        raise ConfigError(f"anneal must be (step, {{stream: weight}}) or (step, {{stream: weight}}, lr_scale), "
                          f"got {anneal!r}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ConfigError(f"anneal: the anneal phase's step must be an integer >= 0, got {start!r}")
    if not isinstance(mapping, Mapping) or not mapping:
        raise ConfigError(f"anneal: the anneal phase (step {start}) needs a non-empty {{stream: weight}} mapping, "
                          f"got {mapping!r}")
    unknown = [k for k in mapping if k not in names]
    if unknown:
        raise ConfigError(f"anneal: the anneal phase (step {start}) names unknown stream {unknown[0]!r}; "
                          f"streams are {list(names)}")
    scale = _lr_scale(f"anneal: the anneal phase (step {start})", rest[0] if rest else 1.0)
    annealed = {name: mapping.get(name, 0.0) for name in names}
    if start == 0:
        return [(0, annealed, scale)]
    return [(0, dict(base or {}), 1.0), (start, annealed, scale)]


def _phase_weights(i: int, start: int, mapping: Mapping, names: Sequence[str], base: Sequence[float]) -> list[float]:
    unknown = [k for k in mapping if k not in names]
    if unknown:
        raise ConfigError(f"weights: phase {i} (step {start}) names unknown stream {unknown[0]!r}; streams are {list(names)}")
    row = []
    for name, default in zip(names, base):
        w = mapping.get(name, default)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"weights: phase {i} (step {start}), stream {name!r}: weight must be a number >= 0, got {w!r}")
        row.append(float(w))
    if sum(row) <= 0:
        raise ConfigError(f"weights: phase {i} (step {start}) gives every stream weight 0")
    return row


def _temper(row: list[float], temperature: float) -> tuple[float, ...]:
    shaped = [w ** (1.0 / temperature) if w > 0 else 0.0 for w in row]
    total = sum(shaped)
    return tuple(w / total for w in shaped)


class SkipRanges:
    """Global steps whose batches are built (so the data is consumed) and dropped.

    Given as ``[(start, end), ...]``, end exclusive, in any order; overlaps are merged.
    """

    def __init__(self, ranges: Any = ()) -> None:
        merged: list[list[int]] = []
        for i, item in enumerate(ranges or ()):
            try:
                start, end = (int(x) for x in item)
            except (TypeError, ValueError):
                raise ConfigError(f"skip_steps[{i}] must be a (start, end) pair of steps, got {item!r}") from None
            if start < 0 or end <= start:
                raise ConfigError(f"skip_steps[{i}] = ({start}, {end}): need 0 <= start < end (end exclusive)")
            merged.append([start, end])
        merged.sort()
        out: list[list[int]] = []
        for start, end in merged:
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        self.ranges = [(a, b) for a, b in out]
        self._starts = [a for a, _ in self.ranges]

    def __contains__(self, step: int) -> bool:
        i = bisect.bisect_right(self._starts, step) - 1
        return i >= 0 and step < self.ranges[i][1]

    def __or__(self, other: "SkipRanges") -> "SkipRanges":
        return SkipRanges(self.ranges + other.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def to_list(self) -> list[list[int]]:
        return [[a, b] for a, b in self.ranges]

    def count_before(self, step: int) -> int:
        """How many skipped steps lie below ``step``."""
        return sum(max(0, min(b, step) - a) for a, b in self.ranges if a < step)
