"""ShuffleBuffer: a seeded window shuffle of one stream's documents.

The buffer reads a window of ``size`` documents from its reader, permutes them with a key
derived from (seed, stream, pass, global worker, window), and hands them out in that order,
token by token if the consumer wants (a document may be split across blocks).

Windows grow at the start of each pass: with ``warmup`` set, window k of a pass holds
``min(size, warmup * 2**k)`` documents (256, 512, ... 8192 by default), so the first batch
waits for a few hundred documents, not for ``size`` (a window must be read whole before its
first document leaves). Window sizes are a function of the window number alone, so a saved
state and an elastic re-plan find the same windows.

The permutation is computed from the records' lengths in the shard indexes, before any token
is read. State is the reader's cursor at the window start, the window number, and how far
into the window the consumer is (``pos`` documents plus ``token_offset`` tokens of the next
one). Restoring recomputes the permutation and fetches only the frames that hold documents
not yet handed on (at most the window a fresh start reads): it never replays the pass. It
lays the window's rest out from the index alone and reads those frames in the order their
first documents leave (``_restore``), so the first batch after a resume waits for the few
dozen frames its own documents are in, not for the window's hundreds: on the 50M-token corpus
of ``tools/bench_peers.py``, a resume halfway through a window of 8192 documents took 0.039-0.065 s
to its first batch with 0 workers and 0.022-0.027 s after (a fresh start: 0.007-0.012 s).

Why a window shuffle and not a reservoir (random-replacement) buffer: in a reservoir, the
time a document stays buffered is geometric, so restoring one re-reads records spread over
~ln(records per frame) windows; a window bounds the restore to one window of frames, which is
what keeps resume latency level with a fresh start. The shard order and each worker's range
order are reshuffled every pass on top of this (see plan.py).

Zero-length records, and records the source skipped as damaged (``on_error="skip"``), are
passed over here; with ``eos_id`` set, EOS follows each document. A loaded window copies no
token: its documents stay views of the frames they were decoded into, and the consumer copies
each run once, into its batch (``DocRun.copy_into``). A window therefore costs its decoded
frames and nothing more (8192 documents of ~1,000 uint16 tokens: about 16 MiB).

After an elastic resume a worker may also be handed the rests of other workers' windows
(``windows_for``: ``{"ranges", "key", "pos", "offset"}``), emitted as windows -k..-1 before
window 0 of that pass: each laid out as a restore would lay it out (the window's order from
its key, the first ``pos`` documents skipped, ``offset`` tokens into the next one).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import ResumeMismatchError, ShardCorruptError
from ..format.reader import DocBatch
from ..planning.rng import derive_key, permutation
from .base import check_state
from .read import ShardReader

_KEYS = ("reader", "window", "loaded", "pos", "token_offset")


@dataclass
class DocRun:
    """Consecutive pieces of documents of one stream (or, with ``streams``, of several
    streams interleaved): ``size`` tokens held as ``parts`` (views of the decoded frames,
    and the EOS after each document), in order."""

    parts: list
    size: int
    shard: np.ndarray
    record: np.ndarray
    token_start: np.ndarray  # offset of each piece in its document
    length: np.ndarray
    done: bool  # the last piece ends its document
    streams: np.ndarray | None = None  # each piece's stream, where a run mixes streams

    def copy_into(self, out: np.ndarray) -> None:
        """Write the run's tokens into ``out`` (``size`` long): one copy of each token."""
        if len(self.parts) == 1:
            out[...] = self.parts[0]
        elif self.parts:
            np.concatenate(self.parts, out=out)

    @property
    def tokens(self) -> np.ndarray:
        out = np.empty(self.size, self.parts[0].dtype if self.parts else np.uint16)
        self.copy_into(out)
        return out


class ShuffleBuffer:
    def __init__(
        self,
        reader: ShardReader,
        *,
        size: int,
        seed: int,
        stream_key: str,
        global_worker: int,
        eos_id: int | None,
        windows_for: Callable[[int], list] | None = None,
        generation: int = 0,
        warmup: int = 0,
    ) -> None:
        if size < 1:
            raise ValueError(f"shuffle buffer size must be >= 1, got {size}")
        if warmup < 0:
            raise ValueError(f"shuffle warm-up must be >= 0, got {warmup}")
        self.reader = reader
        self.size = size
        self.warmup = warmup
        self.seed = seed
        self.stream_key = stream_key
        self.global_worker = global_worker
        self.eos_id = eos_id
        self.windows_for = windows_for or (lambda pass_idx: [])
        self.generation = int(generation)  # statistical resumes so far: each reshuffles the windows
        self._window_start = reader.state_dict()
        self.window_idx = self._first_window(reader.pass_idx)  # within the pass: loaded or next
        self._clear()

    def window_size(self, window: int | None = None) -> int:
        """Documents in window ``window`` of a pass (the current one by default)."""
        return window_size(self.size, self.warmup, self.window_idx if window is None else window)

    def _first_window(self, pass_idx: int) -> int:
        """-k when the pass starts with k saved windows' rests, else 0."""
        return -len(self.windows_for(pass_idx))

    def _prelude(self, pass_idx: int, window: int) -> dict:
        """The saved window's rest emitted as window ``window`` (< 0)."""
        return self.windows_for(pass_idx)[window - self._first_window(pass_idx)]

    def _fill_prelude(self, skip: int | None) -> bool:
        """Lay out the current prelude window (``skip``: a restore's position)."""
        item = self._prelude(self.reader.pass_idx, self.window_idx)
        if not self._fill(int(item["pos"]) if skip is None else skip, unit=item):
            return False
        if skip is None:
            self.token_offset = int(item["offset"])
        return True

    def _clear(self) -> None:
        self.loaded = False
        self._docs = None  # the window's documents in emission order, each a view of its frame
        self._parts = None  # the same, each followed by its EOS: ``_stride`` entries a document
        self._pending: _Pending | None = None  # a restored window's frames not read yet
        self.offsets = None
        self.shard = None
        self.record = None
        self.pos = 0
        self.token_offset = 0

    # -- windows ---------------------------------------------------------------------------
    def _load(self) -> bool:
        """Load the next non-empty window; False when a finite stream is exhausted."""
        while True:
            if self.window_idx < 0:
                self._window_start = self.reader.state_dict()
                if self._fill_prelude(skip=None):
                    return True
                self.window_idx += 1
                continue
            if self.reader.pass_done:
                if not self.reader.next_pass():
                    self._window_start = self.reader.state_dict()
                    return False
                self.window_idx = self._first_window(self.reader.pass_idx)
                continue
            self._window_start = self.reader.state_dict()
            if self._fill(skip=0):
                return True
            self.window_idx += 1

    def _fill(self, skip: int, unit: dict | None = None) -> bool:
        """Read the window at the reader's cursor (or a saved window's rest, ``unit``) and lay
        it out in emission order.

        The order is computed from the records' lengths in the shard indexes, before any
        token is read; with ``skip`` > 0 (a restore) the first ``skip`` documents of the
        order were handed on already and are neither fetched nor laid out. The reader ends at
        the window's end either way (a ``unit`` leaves it alone).
        """
        reading = unit is None
        size = self.window_size()
        ranges = self.reader.peek_ranges(size) if reading else [tuple(r) for r in unit["ranges"]]
        source = self.reader.source
        if reading and skip == 0:
            self.reader.announce()  # indexes and frames start coming while the window is laid out
        shard, record, lengths, order = _window_order(source, ranges, self._key() if reading else int(unit["key"]))
        if len(order) == 0:
            if reading:
                self.reader.skip(len(record))
            return False
        if not 0 <= skip < len(order):
            raise ResumeMismatchError(
                f"ShuffleBuffer({self.stream_key}): saved position {skip} is outside window "
                f"{self.window_idx} of {len(order)} documents"
            )
        wanted = order[skip:]
        # a restore reads its frames as its documents leave; where damaged records may be
        # skipped it reads them all first, since one left out changes the window's layout
        if (skip > 0 or not reading) and getattr(getattr(source, "config", None), "on_error", "raise") == "raise":
            self._restore(order, lengths, shard, record, ranges, skip)
            if reading:
                self.reader.skip(len(record))
            return True
        if skip == 0 and reading:
            docs = self.reader.read(size)
        else:
            runs = _frame_runs(source, shard[np.sort(wanted)], record[np.sort(wanted)], ranges)
            plan_reads = getattr(source, "plan_reads", None)
            if plan_reads is not None:
                plan_reads(runs)  # fetch only the pending documents' frames
            docs = DocBatch.concat([source.read(s, a, b) for s, a, b in runs], source.dtype)
            if reading:
                self.reader.skip(len(record))
        views = _byte_views(docs)
        lens = lengths[order].copy()
        lens[:skip] = 0
        if skip == 0 and len(docs) == len(record):  # every record came back, in window order
            pieces = [views[i] for i in wanted.tolist()]
        else:
            at, present = _locate(docs.shard, docs.record, shard[wanted], record[wanted])
            empty = np.zeros(0, np.uint8)
            # a record the source skipped as damaged (on_error="skip") is laid out empty
            pieces = [views[i] if ok else empty for i, ok in zip(at.tolist(), present.tolist())]
            lens[skip:] = [len(p) // source.dtype.itemsize for p in pieces]
        self._layout(order, lens, shard, record, pieces, source.dtype, skip)
        return True

    def _restore(self, order, lengths, shard, record, ranges, skip: int) -> None:
        """Lay out a saved window's rest at once and read its documents as they are handed
        out: each frame holding pending documents is read, and fetched ahead, in the order in
        which its first document leaves (``_ensure``), so a restore waits for the frames of
        its first batch, not for the whole window's (a random order touches every frame of
        the window, but the first batch needs the few dozen documents it holds)."""
        source = self.reader.source
        lens = lengths[order].copy()
        lens[:skip] = 0
        self._layout(order, lens, shard, record, None, source.dtype, skip)
        units = _restore_units(source, ranges, shard[order[skip:]], record[order[skip:]], skip)
        plan_reads = getattr(source, "plan_reads", None)
        if plan_reads is not None:
            plan_reads([(s, a, b) for s, a, b, _, _ in units])  # fetched in the order they are needed
        self._pending = _Pending(units)

    def _ensure(self, stop: int) -> None:
        """Read the pending frames of a restored window until every document before position
        ``stop`` of its order is laid out."""
        pending = self._pending
        source = self.reader.source
        dtype, stride = source.dtype, self._stride
        fetch_now = getattr(source, "fetch_now", None)
        if fetch_now is not None and pending.ready < stop:  # the frames read below, side by side
            now = itertools.takewhile(lambda u: u[3][0] < stop, itertools.islice(pending.units, pending.next, None))
            fetch_now((s, a, b) for s, a, b, _, _ in now)
        while pending.ready < stop:
            s, a, b, emit, records = pending.units[pending.next]
            docs = source.read(s, a, b)
            if len(docs) != b - a:
                raise ShardCorruptError(f"{source.where(s, None, (a, b))}: {len(docs)} of {b - a} records read back")
            views = _byte_views(docs)
            for e, r in zip(emit, records):
                view = views[r - a].view(dtype)
                self._docs[e] = view
                self._parts[e * stride] = view
            pending.advance()
        if pending.next == len(pending.units):
            self._pending = None

    def _key(self) -> int:
        extra = ("generation", self.generation) if self.generation else ()
        return derive_key("window", self.seed, self.stream_key, self.reader.pass_idx,
                          self.global_worker, self.window_idx, *extra)

    def _layout(self, order, lens, shard, record, pieces, dtype, skip: int) -> None:
        """Index the documents in emission order without copying a token: each stays a view of
        the frame it was decoded into, and the window is ``offsets`` into their virtual
        concatenation, an EOS after each. A run is copied once, by its consumer, straight
        from the frames (``DocRun.copy_into``); laying the window out in one buffer first
        cost a second copy of every token and a window's worth of memory at each fill."""
        out_lens = lens.copy()
        nothing = _EMPTY.view(dtype)
        # pieces None: a restore, every document laid out empty until its frame is read
        docs = [nothing] * (len(order) if pieces is None else skip) + (
            [] if pieces is None else [p.view(dtype) for p in pieces]
        )
        if self.eos_id is None:
            self._stride, parts = 1, docs
        else:
            eos = np.array([self.eos_id], dtype)
            nonempty = lens > 0  # lens[:skip] are 0: documents a restore passes over
            out_lens += nonempty
            self._stride = 2
            parts = [eos] * (2 * len(docs))
            parts[0::2] = docs
            # an empty piece (a record the source skipped as damaged, or one handed on before
            # a restore) gets no EOS
            parts[1 : 2 * skip : 2] = [nothing] * skip
            for i in (np.flatnonzero(~nonempty[skip:]) + skip).tolist():
                parts[2 * i + 1] = nothing
            self._eos = eos
        self._docs = docs
        self._parts = parts
        self.offsets = np.zeros(len(order) + 1, np.int64)
        np.cumsum(out_lens, out=self.offsets[1:])
        self.shard = shard[order]
        self.record = record[order]
        self.loaded = True
        self.pos = skip
        self.token_offset = 0
        self._offsets_list = self.offsets.tolist()
        self._lengths = out_lens  # of each document with its EOS, in emission order
        self._has_empty = not out_lens[skip:].all()
        self._shard_list = self.shard.tolist()
        self._record_list = self.record.tolist()
        self._skip_empty()

    def _cut(self, doc: int, a: int, b: int) -> list:
        """Tokens ``a..b-1`` of document ``doc`` counted with its EOS, as parts."""
        tokens = self._docs[doc]
        n = len(tokens)
        if b <= n:
            return [tokens[a:b]]
        return [tokens[a:], self._eos] if a < n else [self._eos]

    def _skip_empty(self) -> None:
        """Step over documents laid out empty (damaged records skipped by the source)."""
        offsets, n = self._offsets_list, len(self._record_list)
        while self.pos < n and offsets[self.pos + 1] == offsets[self.pos]:
            self.pos += 1
        if self.pos == n:
            self._finish_window()

    def _finish_window(self) -> None:
        self._clear()
        self.window_idx += 1
        self._window_start = self.reader.state_dict()

    # -- consumer API ----------------------------------------------------------------------
    def remaining(self) -> int | None:
        """Tokens left in the current document (loading a window if needed); None at the end."""
        if not self.loaded and not self._load():
            return None
        return self._offsets_list[self.pos + 1] - self._offsets_list[self.pos] - self.token_offset

    def doc_length(self) -> int:
        """Full length of the current document (call after ``remaining()``)."""
        return self._offsets_list[self.pos + 1] - self._offsets_list[self.pos]

    def peek_token(self) -> int:
        if self._pending is not None:
            self._ensure(self.pos + 1)
        tokens = self._docs[self.pos]
        return int(tokens[self.token_offset]) if self.token_offset < len(tokens) else self.eos_id

    def take(self, n: int) -> tuple[np.ndarray, int, int, int, bool]:
        """Up to ``n`` tokens of the current document: (tokens, shard, record, token_start, done).

        Call ``remaining()`` first; it guarantees a current document.
        """
        if self._pending is not None:
            self._ensure(self.pos + 1)
        start = self._offsets_list[self.pos] + self.token_offset
        stop = self._offsets_list[self.pos + 1]
        k = min(n, stop - start)
        parts = self._cut(self.pos, self.token_offset, self.token_offset + k)
        piece = parts[0] if len(parts) == 1 else np.concatenate(parts)
        meta = (self._shard_list[self.pos], self._record_list[self.pos], self.token_offset)
        done = start + k == stop
        if done:
            self._advance(1)
        else:
            self.token_offset += k
        return piece, meta[0], meta[1], meta[2], done

    def known_lengths(self, max_docs: int) -> np.ndarray | None:
        """Full lengths of the current document and of up to ``max_docs - 1`` after it, all in
        the loaded window; None where no window is loaded or the window holds documents laid
        out empty (skipped records), which the consumer then takes one run at a time."""
        if not self.loaded or self._has_empty:
            return None
        return self._lengths[self.pos : min(self.pos + max_docs, len(self._record_list))]

    def upcoming_lengths(self, max_docs: int) -> np.ndarray:
        """Full lengths of the documents after the current one, within this window."""
        lo = self.pos + 1
        hi = min(lo + max_docs, len(self._record_list))
        return self._lengths[lo:hi]

    def take_run(self, n: int, max_docs: int) -> DocRun:
        """Up to ``n`` tokens from at most ``max_docs`` consecutive documents, the current one
        first; only the last may be cut short. One slice of the window's parts (documents and
        their EOS), cut at its ends; no per-document work.
        """
        pos = self.pos
        offsets = self._offsets_list
        first = offsets[pos] + self.token_offset
        last_doc = min(pos + max_docs, len(self._record_list))  # exclusive
        limit = first + n
        # documents pos..j-1 end at or before the limit
        j = bisect.bisect_right(offsets, limit) - 1
        whole = min(max(j, pos), last_doc)
        if whole < last_doc and offsets[whole] < limit:
            stop, docs, done = limit, whole + 1 - pos, False  # the last document is cut
        else:
            stop, docs, done = offsets[whole], whole - pos, True
        length = self._lengths[pos : pos + docs].copy()
        token_start = np.zeros(docs, np.int64)
        if docs:
            token_start[0] = self.token_offset
            length[0] -= self.token_offset
            length[-1] -= offsets[pos + docs] - stop
        if self._pending is not None:
            self._ensure(pos + max(docs, 1))
        # drop damaged (empty) documents
        keep = length > 0 if self._has_empty else slice(None)
        stride = self._stride
        if docs == 0:
            parts = []
        elif docs == 1:
            base = self._offsets_list[pos]
            parts = self._cut(pos, first - base, stop - base)
        else:
            parts = self._parts[pos * stride : (pos + docs) * stride]
            last = pos + docs - 1
            if not done:  # the last document is cut at the limit
                parts[-stride:] = self._cut(last, 0, stop - self._offsets_list[last])
            if self.token_offset:  # the first one was begun already
                parts[:stride] = self._cut(pos, self.token_offset, self._offsets_list[pos + 1] - self._offsets_list[pos])
        run = DocRun(
            parts=parts,
            size=stop - first,
            shard=self.shard[pos : pos + docs][keep],
            record=self.record[pos : pos + docs][keep],
            token_start=token_start[keep],
            length=length[keep],
            done=done,
        )
        if done:
            self._advance(docs)
        else:
            self._advance(docs - 1)
            self.token_offset = stop - self._offsets_list[self.pos]
        return run

    def _advance(self, docs: int) -> None:
        if docs == 0:
            return
        self.pos += docs
        self.token_offset = 0
        self._skip_empty()

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "reader": dict(self._window_start),
            "window": self.window_idx,
            "loaded": self.loaded,
            "pos": self.pos,
            "token_offset": self.token_offset,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ResumeMismatchError`` unless ``state`` points into this worker's data:
        reader cursor in its ranges, position inside the window, token offset inside the
        document (reads record indexes only, never tokens; leaves this buffer unusable)."""
        check_state(state, _KEYS, "ShuffleBuffer")
        self.reader.load_state_dict(state["reader"])
        where = f"ShuffleBuffer({self.stream_key})"
        self.window_idx = int(state["window"])
        pos, token_offset = int(state["pos"]), int(state["token_offset"])
        if self.window_idx < self._first_window(self.reader.pass_idx) or pos < 0 or token_offset < 0:
            raise ResumeMismatchError(
                f"{where}: window {self.window_idx}, pos {pos}, token_offset {token_offset}: none may be negative"
            )
        if not state["loaded"]:
            return
        if self.window_idx < 0:
            item = self._prelude(self.reader.pass_idx, self.window_idx)
            if pos < int(item["pos"]):
                raise ResumeMismatchError(f"{where}: pos {pos} is before where resumed window "
                                          f"{self.window_idx} starts ({item['pos']})")
            return
        shard, record, lengths, order = _window_order(
            self.reader.source, self.reader.peek_ranges(self.window_size()), self._key(), keep=True
        )
        if pos >= len(order):
            raise ResumeMismatchError(f"{where}: pos {pos} is outside window {self.window_idx} of {len(order)} documents")
        length = int(lengths[order[pos]]) + (self.eos_id is not None)
        if token_offset >= length:
            raise ResumeMismatchError(
                f"{where}: token_offset {token_offset} is outside document (shard {int(shard[order[pos]])}, "
                f"record {int(record[order[pos]])}) of {length} tokens"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, _KEYS, "ShuffleBuffer")
        self._clear()
        self.reader.load_state_dict(state["reader"])
        self._window_start = self.reader.state_dict()
        self.window_idx = int(state["window"])
        if self.window_idx < self._first_window(self.reader.pass_idx):
            raise ResumeMismatchError(f"ShuffleBuffer({self.stream_key}): window {self.window_idx} does not exist")
        if state["loaded"]:
            fill = self._fill_prelude if self.window_idx < 0 else self._fill
            if not fill(skip=int(state["pos"])):
                raise ResumeMismatchError(f"ShuffleBuffer({self.stream_key}): the saved window is empty on re-read")
            token_offset = int(state["token_offset"])
            if self.loaded and not 0 <= token_offset < self.doc_length():
                raise ResumeMismatchError(
                    f"ShuffleBuffer({self.stream_key}): token_offset {token_offset} is outside the "
                    f"current document ({self.doc_length()} tokens) of window {self.window_idx}"
                )
            self.token_offset = token_offset

    @staticmethod
    def position(state: dict[str, Any], ranges_for) -> tuple[int, int]:
        """(pass, records handed on) of a saved state: the reader cursor at the window start
        plus the documents of the window already emitted (the window's empty records are not
        counted there, so this is approximate by at most those)."""
        check_state(state, _KEYS, "ShuffleBuffer")
        pass_idx = int(state["reader"]["pass"])
        records = ShardReader.position(state["reader"], ranges_for(pass_idx))
        return pass_idx, records + (int(state["pos"]) if state["loaded"] else 0)

    def seek(self, pass_idx: int, records: int) -> None:
        """Start at a window boundary ``records`` records into this worker's ``pass_idx``."""
        self._clear()
        self.reader.seek(pass_idx, records)
        self._window_start = self.reader.state_dict()
        self.window_idx = 0

    def work_left(self, state: dict[str, Any]) -> tuple[int, list, list[dict]]:
        """What this worker had not handed on at a saved state, from record indexes only
        (leaves this buffer unusable): (pass, record ranges not yet read, windows' rests
        ``{"ranges", "key", "pos", "offset", "tokens", "docs"}``: its current window's and
        those of its prelude not yet emitted)."""
        self.check_state(state)
        pass_idx = self.reader.pass_idx
        loaded, pos, offset = bool(state["loaded"]), int(state["pos"]), int(state["token_offset"])
        units: list[dict] = []
        if self.window_idx < 0:
            for window in range(self.window_idx, 0):
                current = loaded and window == self.window_idx
                item = self._prelude(pass_idx, window)
                units.append(self._unit(item["ranges"], int(item["key"]), pos if current else int(item["pos"]),
                                        offset if current else int(item["offset"])))
        elif loaded:
            ranges = self.reader.peek_ranges(self.window_size())
            units.append(self._unit(ranges, self._key(), pos, offset))
            self.reader.skip(sum(b - a for _, a, b in ranges))
        return pass_idx, self.reader.unread(), [u for u in units if u["docs"]]

    def _unit(self, ranges, key: int, pos: int, offset: int) -> dict:
        """A saved window's rest, with the tokens and documents it still holds."""
        _, _, lengths, order = _window_order(self.reader.source, ranges, key)
        order = order[pos:]
        tokens = int(lengths[order].sum()) + (len(order) if self.eos_id is not None else 0) - offset
        return {"ranges": [[int(s), int(a), int(b)] for s, a, b in ranges], "key": int(key), "pos": pos,
                "offset": offset, "tokens": tokens, "docs": len(order)}

    def pending_records(self) -> list[tuple[int, int]]:
        """(shard, record) of documents read from the reader but not yet fully emitted."""
        if not self.loaded:
            return []
        return list(zip(self._shard_list[self.pos :], self._record_list[self.pos :]))


def window_size(size: int, warmup: int, window: int) -> int:
    """Documents in window ``window`` of a pass: ``size``, or while warming up (``warmup`` >
    0) ``warmup * 2**window`` up to ``size``. A saved window's rest (``window`` < 0) keeps its
    own ranges."""
    if warmup <= 0 or window < 0:
        return size
    return min(size, warmup << min(window, 63))


def _window_records(source, ranges):
    """(shard, record, num_tokens) of every record in ``ranges``, from the shard indexes.

    A shard whose index cannot be read counts as empty when the source skips damaged data
    (its records are skipped on read too), so fresh fills and restores agree.
    """
    shard, record, lengths = [], [], []
    for s, a, b in ranges:
        shard.append(np.full(b - a, s, np.int64))
        record.append(np.arange(a, b, dtype=np.int64))
        try:
            lengths.append(source.index(s).records["num_tokens"][a:b].astype(np.int64))
        except ShardCorruptError:
            if getattr(getattr(source, "config", None), "on_error", "raise") != "skip":
                raise
            lengths.append(np.zeros(b - a, np.int64))
    if not shard:
        z = np.zeros(0, np.int64)
        return z, z, z
    return np.concatenate(shard), np.concatenate(record), np.concatenate(lengths)


def _nonempty_order(lengths: np.ndarray, key: int) -> np.ndarray:
    keep = np.flatnonzero(lengths > 0)
    return keep[permutation(len(keep), key)]


_ORDERS: dict = {}  # (id(manifest), ranges, key) -> (manifest, (shard, record, lengths, order))
_ORDERS_KEPT = 8


def _window_order(source, ranges, key: int, keep: bool = False) -> tuple:
    """``(shard, record, num_tokens, order)`` of a window: its records (``_window_records``)
    and the emission order of the non-empty ones, read-only.

    A pure function of the stream's manifest, the window's ranges and its key. ``keep``
    leaves it for the next call that asks for the same window, which takes it: a resume
    computes it when it checks each worker's state (``check_state``), and again when it lays
    the window out to build the first batch (about 1 ms for a window of 8192 documents).
    At most the last few are kept, and never where damaged shards may be skipped (the
    records then depend on what was found damaged)."""
    manifest = getattr(source, "manifest", None)
    if manifest is None or getattr(getattr(source, "config", None), "on_error", "raise") == "skip":
        shard, record, lengths = _window_records(source, ranges)
        return shard, record, lengths, _nonempty_order(lengths, key)
    memo = (id(manifest), tuple(tuple(int(x) for x in r) for r in ranges), int(key))
    hit = _ORDERS.pop(memo, None)
    if hit is not None and hit[0] is manifest:
        return hit[1]
    shard, record, lengths = _window_records(source, ranges)
    out = (shard, record, lengths, _nonempty_order(lengths, key))
    for a in out:
        a.setflags(write=False)
    if keep:
        _ORDERS[memo] = (manifest, out)
        while len(_ORDERS) > _ORDERS_KEPT:
            del _ORDERS[next(iter(_ORDERS))]
    return out


def _locate(shards: np.ndarray, records: np.ndarray, want_shards: np.ndarray, want_records: np.ndarray):
    """For each wanted (shard, record): its index among ``(shards, records)`` and whether it is
    there at all. Vectorized: a dict over a window's documents took over 0.1 s on a resume,
    with the prefetch threads contending for the GIL."""
    have = (shards.astype(np.int64) << 40) | records.astype(np.int64)
    want = (want_shards.astype(np.int64) << 40) | want_records.astype(np.int64)
    order = np.argsort(have, kind="stable")
    pos = np.minimum(np.searchsorted(have[order], want), max(len(have) - 1, 0))
    at = order[pos] if len(have) else np.zeros(len(want), np.int64)
    present = (have[at] == want) if len(have) else np.zeros(len(want), bool)
    return at, present


def _frame_runs(source, shard: np.ndarray, record: np.ndarray, ranges) -> list[tuple[int, int, int]]:
    """Record ranges covering whole runs of the frames that hold the given (sorted) records,
    clipped to the window's ``ranges``: one read per run of frames, each frame decoded once."""
    out = []
    for s, a, b in ranges:
        mask = (shard == s) & (record >= a) & (record < b)
        if not mask.any():
            continue
        index = source.index(s)
        frames = np.sort(index.frame_of_record(record[mask]))
        # distinct frames without np.unique, whose first call imports numpy.ma (tens of ms on
        # a resume's path)
        frames = frames[np.concatenate(([True], frames[1:] != frames[:-1]))]
        breaks = np.flatnonzero(np.diff(frames) != 1) + 1
        for run in np.split(frames, breaks):
            lo = max(a, int(index.frames["first_record"][run[0]]))
            hi = min(b, index.record_stop(int(run[-1])))
            out.append((s, lo, hi))
    return out


_EMPTY = np.zeros(0, np.uint8)


class _Pending:
    """A restored window's frames still to read: ``units`` in the order of their first
    document's position, each ``(shard, start, stop, positions, records)`` (the record range
    it reads, and where its pending documents go); every document before position ``ready``
    is laid out."""

    def __init__(self, units: list) -> None:
        self.units = units
        self.next = 0
        self.ready = units[0][3][0] if units else 1 << 62

    def advance(self) -> None:
        self.next += 1
        self.ready = self.units[self.next][3][0] if self.next < len(self.units) else 1 << 62


def _restore_units(source, ranges, shard: np.ndarray, record: np.ndarray, skip: int) -> list:
    """The reads of a restored window: one per frame holding pending documents, from the first
    of them to the last (the frame is decoded whole either way, but no view is made of the
    records around them), ordered by the position of its first pending document.
    ``shard``/``record`` are the pending documents in emission order, from position ``skip``."""
    units = []
    position = np.arange(skip, skip + len(shard), dtype=np.int64)
    for s, a, b in ranges:
        mask = (shard == s) & (record >= a) & (record < b)
        if not mask.any():
            continue
        index = source.index(s)
        recs, pos = record[mask], position[mask]
        frames = index.frame_of_record(recs)
        by_frame = np.argsort(frames, kind="stable")  # stable: each frame's documents stay in emission order
        frames, recs, pos = frames[by_frame], recs[by_frame], pos[by_frame]
        heads = np.flatnonzero(np.concatenate(([True], frames[1:] != frames[:-1])))
        lo = np.minimum.reduceat(recs, heads).tolist()
        hi = (np.maximum.reduceat(recs, heads) + 1).tolist()
        bounds = heads.tolist() + [len(recs)]
        recs, pos = recs.tolist(), pos.tolist()
        for i, (l, h) in enumerate(zip(lo, hi)):
            units.append((s, l, h, pos[bounds[i] : bounds[i + 1]], recs[bounds[i] : bounds[i + 1]]))
    units.sort(key=lambda u: u[3][0])
    return units


def _byte_views(docs: DocBatch) -> list[np.ndarray]:
    """One uint8 view per document."""
    if docs.views is not None:
        return docs.views
    src = docs.tokens.view(np.uint8)
    size = docs.dtype.itemsize
    bounds = (docs.offsets * size).tolist()
    return [src[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
