"""Interleaver: mix several streams by token share with a deterministic deficit schedule.

Each time a new document is needed, the interleaver picks the active stream that is furthest
behind its share: the one with the smallest ``emitted_tokens[i] / weight[i]`` (ties go to the
lower index), and counts the document's full length to it. Since the weighted mean of the
ratios is the total, the chosen stream is never ahead, so after any prefix of the output a
stream exceeds its share ``weight[i] * total`` by less than one of its documents; a stream
lags by at most the documents the others are ahead by. No coin flips: the schedule is a
function of the counters, which are the state.

Streams that run out (finite mode) drop out and the others renormalize automatically.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .base import check_state
from .shuffle import ShuffleBuffer

_KEYS = ("emitted", "current", "sources")


class Interleaver:
    def __init__(self, sources: Sequence[ShuffleBuffer], weights: Sequence[float]) -> None:
        if len(sources) != len(weights) or not sources:
            raise ValueError("Interleaver needs one weight per source")
        self.sources = list(sources)
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.emitted = [0] * len(sources)
        self.current = -1  # stream of the document in progress, -1 between documents
        self.active = [w > 0 for w in self.weights]

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

    def state_dict(self) -> dict[str, Any]:
        return {
            "emitted": list(self.emitted),
            "current": self.current,
            "sources": [s.state_dict() for s in self.sources],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, _KEYS, "Interleaver")
        if len(state["sources"]) != len(self.sources):
            raise ValueError(
                f"Interleaver: state has {len(state['sources'])} streams, this pipeline {len(self.sources)}"
            )
        self.emitted = [int(x) for x in state["emitted"]]
        self.current = int(state["current"])
        for source, sub in zip(self.sources, state["sources"]):
            source.load_state_dict(sub)
        self.active = [w > 0 for w in self.weights]
