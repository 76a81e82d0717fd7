"""Interleaver: mix several streams by token share with a deterministic deficit schedule.

Each time a new document is needed, the interleaver picks the active stream that is furthest
behind its share: the one with the smallest ``emitted_tokens[i] / weight[i]`` (ties go to the
lower index), and counts the document's full length to it. Since the weighted mean of the
ratios is the total, the chosen stream is never ahead, so after any prefix of the output a
stream exceeds its share ``weight[i] * total`` by less than one of its documents; a stream
lags by at most the documents the others are ahead by. No coin flips: the schedule is a
function of the counters, which are the state.

Streams that run out (finite mode) drop out and the others renormalize automatically.

The weights come from a ``MixtureSchedule`` keyed by the global step: before each batch the
pipeline calls ``set_step(step)``. Entering a new phase restarts the counters (crediting the
rest of a document in progress to its stream), so the share bound holds from the phase's
first step and a newly up-weighted stream does not monopolize batches to catch up on a
deficit accumulated under the old weights.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import ResumeMismatchError
from ..schedule import MixtureSchedule
from .base import check_state
from .shuffle import ShuffleBuffer

_KEYS = ("emitted", "current", "phase", "sources")


class Interleaver:
    def __init__(self, sources: Sequence[ShuffleBuffer], schedule: MixtureSchedule | Sequence[float]) -> None:
        if not isinstance(schedule, MixtureSchedule):
            names = [getattr(s, "stream_key", str(i)) for i, s in enumerate(sources)]
            schedule = MixtureSchedule.build(names, list(schedule))
        if len(sources) != len(schedule.names) or not sources:
            raise ValueError("Interleaver needs one weight per source")
        self.sources = list(sources)
        self.schedule = schedule
        self.exhausted = [False] * len(sources)
        self.current = -1  # stream of the document in progress, -1 between documents
        self._enter_phase(0)

    def _enter_phase(self, phase: int) -> None:
        self.phase = phase
        self.weights = list(self.schedule.weights[phase])
        self.emitted = [0] * len(self.sources)
        if self.current >= 0:  # the rest of the open document counts to the new phase
            self.emitted[self.current] = self.sources[self.current].remaining() or 0
        self.active = [w > 0 and not x for w, x in zip(self.weights, self.exhausted)]

    def set_step(self, step: int) -> None:
        """The global step of the batch about to be built: switch phase if it starts one."""
        starts = self.schedule.starts
        if starts[self.phase] <= step and (self.phase + 1 == len(starts) or step < starts[self.phase + 1]):
            return  # the usual case: still in the same phase
        phase = self.schedule.phase_at(step)
        if phase != self.phase:
            self._enter_phase(phase)

    def _pick(self) -> int:
        """The stream of the next document, skipping exhausted ones; -1 when all are done."""
        while True:
            best, best_ratio = -1, 0.0
            for i, w in enumerate(self.weights):
                if self.active[i]:
                    ratio = self.emitted[i] / w
                    if best < 0 or ratio < best_ratio:
                        best, best_ratio = i, ratio
            if best < 0:
                return -1
            if self.sources[best].remaining() is not None:
                return best
            self.active[best] = False
            self.exhausted[best] = True

    def next_stream(self) -> int:
        """The stream the next token comes from (committing to a new document if needed)."""
        if self.current < 0:
            stream = self._pick()
            if stream < 0:
                return -1
            self.current = stream
            self.emitted[stream] += self.sources[stream].doc_length()
        return self.current

    def take(self, n: int):
        """Up to ``n`` tokens of the current document, as ``(stream, tokens, shard, record,
        token_start, done)``; None when every stream is exhausted."""
        stream = self.next_stream()
        if stream < 0:
            return None
        source = self.sources[stream]
        source.remaining()
        tokens, shard, record, token_start, done = source.take(n)
        if done:
            self.current = -1
        return stream, tokens, shard, record, token_start, done

    def take_run(self, n: int):
        """Up to ``n`` tokens from the documents the schedule gives one stream in a row, as
        ``(stream, DocRun)``; None when every stream is exhausted.

        Equivalent to repeated ``take`` calls: the run length is the number of further
        documents for which this stream stays the furthest behind its share, computed from
        the counters and the upcoming document lengths in one vectorized step.
        """
        stream = self.next_stream()
        if stream < 0:
            return None
        source = self.sources[stream]
        max_docs = 1 + self._extra_docs(stream, source)
        run = source.take_run(n, max_docs)
        if len(run.length) > 1:
            # the first document was counted when picked; count the others now
            full = run.length[1:].copy()
            if not run.done:
                full[-1] = source.doc_length()
            self.emitted[stream] += int(full.sum())
        self.current = -1 if run.done else stream
        return stream, run

    def _extra_docs(self, stream: int, source) -> int:
        """How many documents after the current one the schedule would also give ``stream``."""
        others = [j for j in range(len(self.weights)) if j != stream and self.active[j]]
        if not others:
            return 1 << 30
        w = self.weights[stream]
        if w <= 0:  # the rest of a document begun before its stream's weight went to 0
            return 0
        ratios = [self.emitted[j] / self.weights[j] for j in others]
        threshold = min(ratios)
        first_min = others[ratios.index(threshold)]
        upcoming = source.upcoming_lengths(64)  # a longer run is just split
        if len(upcoming) == 0:
            return 0
        # the document after k picks is taken while (emitted + sum of k lengths) / w beats
        # the best other ratio (ties go to the lower stream index, as in _pick)
        prefix = self.emitted[stream] + np.concatenate([[0], np.cumsum(upcoming[:-1])])
        ratio = prefix / w
        ok = ratio < threshold if stream > first_min else ratio <= threshold
        return int(np.argmin(ok)) if not ok.all() else len(ok)

    def peek_token(self) -> int | None:
        """The next token without consuming it (commits to the next document's stream, which
        changes nothing observable: the choice is a function of the counters)."""
        stream = self.next_stream()
        if stream < 0:
            return None
        return self.sources[stream].peek_token()

    @staticmethod
    def source_states(state: dict[str, Any]) -> list[dict[str, Any]]:
        """The per-stream states nested in a saved state."""
        check_state(state, _KEYS, "Interleaver")
        return list(state["sources"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "emitted": list(self.emitted),
            "current": self.current,
            "phase": self.phase,
            "sources": [s.state_dict() for s in self.sources],
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Validate ``state`` and every stream's nested state (see ``ShuffleBuffer.check_state``)."""
        self._check_own(state)
        for source, sub in zip(self.sources, state["sources"]):
            source.check_state(sub)

    def _check_own(self, state: dict[str, Any]) -> None:
        check_state(state, _KEYS, "Interleaver")
        n = len(self.sources)
        if len(state["sources"]) != n or len(state["emitted"]) != n:
            raise ResumeMismatchError(
                f"Interleaver: state has {len(state['sources'])} streams, this pipeline {n}"
            )
        phase, current = int(state["phase"]), int(state["current"])
        if not 0 <= phase < len(self.schedule.starts):
            raise ResumeMismatchError(f"Interleaver: phase {phase} is not one of the schedule's {len(self.schedule.starts)}")
        if not -1 <= current < n:
            raise ResumeMismatchError(f"Interleaver: current stream {current} is not in -1..{n - 1}")
        if any(int(x) < 0 for x in state["emitted"]):
            raise ResumeMismatchError(f"Interleaver: negative emitted tokens {state['emitted']}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_own(state)
        n = len(self.sources)
        phase, current = int(state["phase"]), int(state["current"])
        for source, sub in zip(self.sources, state["sources"]):
            source.load_state_dict(sub)
        self.current = -1
        self.exhausted = [False] * n
        self._enter_phase(phase)
        self.emitted = [int(x) for x in state["emitted"]]
        self.current = current
