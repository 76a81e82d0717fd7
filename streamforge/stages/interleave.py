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

from typing import Sequence, TypedDict

import numpy as np

from ..errors import ConfigError, ResumeMismatchError
from ..planning.schedule import MixtureSchedule
from .base import check_state
from .runs import DocRun
from .shuffle import ShuffleBuffer, ShuffleState


class InterleaverState(TypedDict):
    """A saved ``Interleaver``: tokens ``emitted`` per stream, the ``current`` stream (-1:
    none), the schedule ``phase``, and one ``ShuffleBuffer`` state per stream (``sources``)."""

    emitted: list[int]
    current: int
    phase: int
    sources: list[ShuffleState]


STATE_KEYS: tuple[str, ...] = tuple(InterleaverState.__annotations__)  # the keys of a saved state
_LOOKAHEAD = 64  # documents after its current one a stream shows a schedule (a longer run is just split)
_STRETCH = 1 << 62  # budget of a stretch of the schedule: every document the streams' windows show
_NONE = np.zeros(0, np.int64)
_RUN_FIELDS = ("shard", "record", "token_start", "length")  # a DocRun's per-document fields
_ZERO = np.zeros(1, np.int64)
_WHOLE = 1 << 62  # a token budget no document reaches


class Interleaver:
    """Several streams' documents mixed by token share: the third stage of a worker's
    pipeline. Implements the stage contract (``stages.base.Stage``): ``next()`` is the rest
    of the next document as ``(stream, DocRun)``; the packer pulls runs of a token budget
    with ``take_run`` and whole documents with ``take``.

    Args:
        sources: one ``ShuffleBuffer`` per stream (their states are saved under
            ``"sources"``).
        schedule: a ``MixtureSchedule``, or one weight per stream for a single phase.

    Raises:
        ConfigError: the schedule does not have one weight per source, or there is no source.
    """

    def __init__(self, sources: Sequence[ShuffleBuffer], schedule: MixtureSchedule | Sequence[float]) -> None:
        if not isinstance(schedule, MixtureSchedule):
            names = [getattr(s, "stream_key", str(i)) for i, s in enumerate(sources)]
            schedule = MixtureSchedule.build(names, list(schedule))
        if len(sources) != len(schedule.names) or not sources:
            raise ConfigError("Interleaver needs one weight per source")
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
        self._mixing = sum(self.active) > 1  # two streams or more to schedule between
        self._stretch = None

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
            self._mixing = sum(self.active) > 1
            self._stretch = None

    def next_stream(self) -> int:
        """The stream the next token comes from (committing to a new document if needed)."""
        if self.current < 0:
            stream = self._pick()
            if stream < 0:
                return -1
            self.current = stream
            self.emitted[stream] += self.sources[stream].doc_length()
            stretch = self._stretch
            # ``_pick`` follows the schedule the stretch holds, so it picks the stretch's next
            # document (as ``peek_token`` between batches does) and the stretch stays
            if stretch is not None and not (stretch[0][stretch[2]] == stream
                                            and stretch[1][stretch[2]] == self.sources[stream].remaining()):
                self._stretch = None
        return self.current

    def forget_schedule(self) -> None:
        """Drop the stretch of the schedule computed ahead: the streams were moved from outside
        (``WorkerPipeline.seek``)."""
        self._stretch = None

    def take(self, n: int):
        """Up to ``n`` tokens of the current document, as ``(stream, tokens, shard, record,
        token_start, done)``; None when every stream is exhausted."""
        stream = self.next_stream()
        if stream < 0:
            return None
        self._stretch = None
        source = self.sources[stream]
        source.remaining()
        tokens, shard, record, token_start, done = source.take(n)
        if done:
            self.current = -1
        return stream, tokens, shard, record, token_start, done

    def take_run(self, n: int):
        """Up to ``n`` tokens as one ``(stream, DocRun)``; None when every stream is exhausted.
        Equivalent to repeated ``take`` calls.

        One stream's run is the documents for which it stays the furthest behind its share,
        computed from the counters and the upcoming document lengths in one vectorized step.
        With two or more streams the schedule hands over every document or two, so such runs
        are short and a pick, a look-ahead and a run per document would cost more than the
        tokens: where the streams' windows hold the documents, a whole stretch of the
        schedule is computed at once (``_schedule``, kept across calls by ``_planned``), taken
        as one run per stream and handed out as one run whose pieces carry their streams
        (stream -1, ``DocRun.streams``).
        """
        if self._mixing:
            plan = self._planned(n)
            if plan is not None:
                return self._take_plan(*plan)
        self._stretch = None
        stream = self.next_stream()
        if stream < 0:
            return None
        return stream, self._take(stream, n, 1 + self._extra_docs(stream, self.sources[stream]))

    def take_block(self, ext, grid: np.ndarray) -> dict | None:
        """A whole batch of one stream in one compiled call: the [R, T+1] ``grid`` filled, each
        row's column T holding the token after it (the stream's next token after the last
        row), and the batch's piece columns, where one stream is active and its loaded window
        holds the batch and the token after it (``ShuffleBuffer.take_block``); the counters
        move as ``take_run`` and ``peek_token`` move them. None otherwise, nothing taken."""
        if self._mixing:
            return None
        stream = self.next_stream()
        if stream < 0 or not self.active[stream]:
            return None
        got = self.sources[stream].take_block(ext, stream, grid)
        if got is None:
            return None
        pieces, done, begun = got
        self._stretch = None
        self.emitted[stream] += begun  # as _take counts the documents after the first
        self.current = -1 if done else stream
        self.next_stream()  # the document of the token after the batch, as peek_token commits to it
        return pieces

    def _planned(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """``_schedule(n)``, cut from a longer stretch of the schedule computed once for every
        document the streams' windows show (``_stretch``: streams, tokens left, next entry).

        The schedule's picks are a sorted merge of ratios that consuming a document does not
        change for the documents after it (each is its stream's emitted tokens plus the
        lengths picked before it, over the weight), so a stretch computed ahead is the
        prefix a fresh ``_schedule`` would compute at any later point, for as long as it
        lasts; it is computed afresh when it cannot fill ``n`` (the windows may show more by
        then), and dropped whenever the counters move otherwise (a phase, a pick made one
        document at a time, a stream run out, a restore). A batch then costs a slice and a
        cumsum instead of the schedule's two dozen numpy calls.
        """
        stretch = self._stretch
        if stretch is not None:
            filled = np.cumsum(stretch[1][stretch[2]:])
        if stretch is None or filled[-1] < n:
            plan = self._schedule(_STRETCH)
            if plan is None:
                self._stretch = None
                return None
            stretch = (plan[0], plan[1], 0)
            filled = np.cumsum(plan[1])
        streams, left, at = stretch
        last = min(int(np.searchsorted(filled, n)), len(filled) - 1)  # fills the budget
        stop = at + last + 1
        part = left[at:stop].copy()
        taken = part.copy()
        over = max(0, int(filled[last]) - n)
        taken[last] -= over
        if over:  # the last document is cut: its rest opens the next plan
            left[stop - 1] = over
            self._stretch = (streams, left, stop - 1)
        else:
            self._stretch = (streams, left, stop) if stop < len(left) else None
        return streams[at:stop], part, taken

    def _take(self, stream: int, n: int, max_docs: int) -> DocRun:
        """A run of up to ``n`` tokens from at most ``max_docs`` documents of ``stream``, the
        current one first (already counted), the others counted here."""
        source = self.sources[stream]
        run = source.take_run(n, max_docs)
        if len(run.length) > 1:  # the full lengths of the documents after the first
            full = sum(run.length[1:].tolist())  # a few dozen: cheaper than a numpy reduction
            if not run.done:
                full += source.doc_length() - int(run.length[-1])
            self.emitted[stream] += full
        self.current = -1 if run.done else stream
        return run

    def _schedule(self, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The documents the schedule hands out next, for up to ``budget`` tokens, as
        ``(stream, tokens left, tokens taken)`` arrays in their order, the document in
        progress first; None where the next pick must be made one stream at a time.

        A stream's k-th next document is picked at the share ratio (emitted tokens plus the
        full lengths of its k documents before it) / weight, and picks go in increasing
        ratio, ties to the lower stream (``_pick``): the schedule is one sort of every
        active stream's next ratios. A stream contributes the documents its loaded window
        holds (``known_lengths``) and, last, the ratio of the first document it does not
        hold, whose length is unknown: the schedule stops before that pick, and at the
        document that fills the budget. Ratios are float64 divisions of exact integer
        counts by the weight, as ``_pick`` computes them.
        """
        cur = self.current
        active = [i for i, a in enumerate(self.active) if a]
        if len(active) < 2 or (cur >= 0 and self.weights[cur] <= 0):
            return None
        rest = 0
        blocks = []
        for i in active:
            known = self.sources[i].known_lengths(_LOOKAHEAD + 1)
            if i == cur:
                if known is None:
                    return None
                rest = self.sources[i].remaining()  # a loaded window: no load, just arithmetic
                known = known[1:]
            blocks.append(_NONE if known is None else known)
        sizes = [len(b) + 1 for b in blocks]
        # per stream: 0, then its known lengths; the last entry of each stream stands for
        # its first unknown document
        vals = np.concatenate([x for b in blocks for x in (_ZERO, b)])
        ends = np.cumsum(sizes)
        starts = ends - sizes
        total = np.cumsum(vals)
        stream_of = np.repeat(np.asarray(active, np.int64), sizes)
        prefix = total - np.repeat(total[starts], sizes)  # the stream's tokens picked before
        emitted = np.asarray([self.emitted[i] for i in active], np.int64)
        weights = np.asarray([self.weights[i] for i in active], np.float64)
        ratio = (np.repeat(emitted, sizes) + prefix) / np.repeat(weights, sizes)
        unknown = np.zeros(len(vals), bool)
        unknown[ends - 1] = True
        # a document after its own stream's budget's worth is never reached
        candidates = np.flatnonzero(unknown | (prefix < budget))
        # a stable sort: equal ratios stay in stream order, the lower stream first
        order = candidates[np.argsort(ratio[candidates], kind="stable")]
        picks = order[: int(np.argmax(unknown[order]))]  # up to the first unknown document
        left = vals[picks + 1]
        streams = stream_of[picks]
        if cur >= 0:
            streams = np.concatenate(([cur], streams))
            left = np.concatenate(([rest], left))
        if len(streams) == 0:
            return None
        filled = np.cumsum(left)
        last = min(int(np.searchsorted(filled, budget)), len(left) - 1)  # fills the budget
        taken = left[: last + 1].copy()
        taken[last] -= max(0, int(filled[last]) - budget)
        return streams[: last + 1], left[: last + 1], taken

    def _take_plan(self, streams: np.ndarray, left: np.ndarray, taken: np.ndarray) -> tuple[int, DocRun]:
        """The documents of a schedule (``_schedule``): one ``ShuffleBuffer.take_run`` per
        stream, their pieces laid out in the schedule's order as one run (``stream`` -1), and
        each new document counted to its stream at its full length, as ``_pick`` counts it.

        A schedule holds a few dozen documents of a handful of streams, so its bookkeeping is
        done on Python lists (numpy's per-call cost is larger than the work here). The run's
        tokens stay the streams' parts (views of the decoded frames, and EOS), regrouped in
        the schedule's order; its consumer copies them once (``DocRun.copy_into``)."""
        ids = streams.tolist()
        sizes = taken.tolist()
        counted = left.tolist()
        cut = sizes[-1] < counted[-1]
        if self.current >= 0:
            counted[0] = 0  # the document in progress was counted when it was picked
        per: dict[int, list[int]] = {}  # stream -> [tokens, documents, tokens counted]
        ranks = []  # each document's place among its stream's
        for stream, size, count in zip(ids, sizes, counted):
            entry = per.get(stream)
            if entry is None:
                per[stream] = entry = [0, 0, 0]
            ranks.append(entry[1])
            entry[0] += size
            entry[1] += 1
            entry[2] += count
        if len(per) == 1:  # one stream: a plain run
            stream = ids[0]
            if self.current < 0:
                self.current = stream
                self.emitted[stream] += counted[0]
            return stream, self._take(stream, sum(sizes), len(ids))
        runs, groups, base = [], {}, {}
        done_docs = 0
        for stream in sorted(per):
            size, docs, count = per[stream]
            run = self.sources[stream].take_run(size, docs)
            self.emitted[stream] += count
            groups[stream] = _by_document(run)
            base[stream] = done_docs  # where its documents start in the runs laid end to end
            done_docs += len(run.length)
            runs.append(run)
        self.current = ids[-1] if cut else -1
        parts, gather = [], []
        for stream, j in zip(ids, ranks):  # each document's parts and fields, in the schedule's order
            parts += groups[stream][j]
            gather.append(base[stream] + j)
        laid = np.concatenate([getattr(r, f) for f in _RUN_FIELDS for r in runs]).reshape(len(_RUN_FIELDS), -1)
        fields = dict(zip(_RUN_FIELDS, laid[:, gather]))
        return -1, DocRun(parts=parts, size=sum(sizes), done=not cut, streams=streams.astype(np.int16), **fields)

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

    # -- stage contract --------------------------------------------------------------------
    def __iter__(self) -> Interleaver:
        return self

    def __next__(self) -> tuple[int, DocRun]:
        """The next document, or the rest of the one in progress: ``(stream, DocRun)``."""
        got = self.take(_WHOLE)
        if got is None:
            raise StopIteration
        stream, tokens, shard, record, token_start, done = got
        fields = np.array([[shard, record, token_start, len(tokens)]], np.int64).T
        shard, record, token_start, length = fields
        return stream, DocRun(parts=[tokens], size=len(tokens), shard=shard, record=record,
                              token_start=token_start, length=length, done=done)

    def close(self) -> None:
        for source in self.sources:
            source.close()

    @staticmethod
    def source_states(state: InterleaverState) -> list[ShuffleState]:
        """The per-stream states nested in a saved state."""
        check_state(state, STATE_KEYS, "Interleaver")
        return list(state["sources"])

    def state_dict(self) -> InterleaverState:
        return {
            "emitted": list(self.emitted),
            "current": self.current,
            "phase": self.phase,
            "sources": [s.state_dict() for s in self.sources],
        }

    def check_state(self, state: InterleaverState) -> None:
        """Validate ``state`` and every stream's nested state (see ``ShuffleBuffer.check_state``)."""
        self._check_own(state)
        for source, sub in zip(self.sources, state["sources"]):
            source.check_state(sub)

    def _check_own(self, state: InterleaverState) -> None:
        check_state(state, STATE_KEYS, "Interleaver")
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

    def load_state_dict(self, state: InterleaverState) -> None:
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


def _by_document(run: DocRun) -> list[list]:
    """A run's parts grouped by document piece (one list per entry of ``run.length``).

    ``ShuffleBuffer.take_run`` lays a document out as one part (its view of the frame) or,
    with EOS, two (the view and the EOS); only the run's first and last documents may be
    cut to one part (a cut before the EOS, or the EOS alone). So the first document has one
    part exactly when that part is the whole piece, each document in the middle two, and
    the last what is left."""
    parts, lengths = run.take_parts(), run.length
    docs = len(lengths)
    if len(parts) == docs:
        return [[part] for part in parts]
    if docs == 1:
        return [parts]
    head = 1 if len(parts[0]) == lengths[0] else 2
    tail = head + 2 * (docs - 2)
    groups = [parts[:head]]
    groups += [parts[i : i + 2] for i in range(head, tail, 2)]
    groups.append(parts[tail:])
    return groups
