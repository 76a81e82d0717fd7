"""ShuffleBuffer: a seeded window shuffle of one stream's documents.

The buffer reads a window of documents from its source (a ``ShardReader``), permutes them
with a key derived from (seed, stream, pass, global worker, window), and hands them out in
that order, token by token if the consumer wants (a document may be split across blocks).
Window sizes and orders live in ``window_order``: with ``warmup`` set, window k of a pass
holds ``min(size, warmup * 2**k)`` documents, so the first batch waits for a few hundred
documents, not for ``size`` (a window is read whole before its first document leaves).

The permutation is computed from the records' lengths in the shard indexes, before any token
is read. State is the reader's cursor at the window start, the window number, and how far
into the window the consumer is (``pos`` documents plus ``token_offset`` tokens of the next
one). Restoring recomputes the permutation and fetches only the frames that hold documents
not yet handed on, in the order those documents leave (``window_reads``): it never replays
the pass, and the first batch after a resume waits for the frames its own documents are in.

A window shuffle, not a reservoir (random-replacement) buffer: in a reservoir the time a
document stays buffered is geometric, so restoring one re-reads records spread over ~ln(records
per frame) windows; a window bounds the restore to one window of frames.

Zero-length records, and records the source skipped as damaged (``on_error="skip"``), are
passed over here; with ``eos_id`` set, EOS follows each document. A loaded window copies no
token: its documents stay views of the frames they were decoded into, and the consumer copies
each run once, into its batch (``DocRun.copy_into``).

After an elastic resume a worker may also be handed the rests of other workers' windows
(``windows_for``: ``{"ranges", "key", "pos", "offset"}``), emitted as windows -k..-1 before
window 0 of that pass: each laid out as a restore would lay it out (the window's order from
its key, the first ``pos`` documents skipped, ``offset`` tokens into the next one). A piece
of a window's rest (the re-plan deals a rest's documents over several workers) also has a
``stop``: its order ends there, and the window's next documents are another worker's.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, TypedDict

import numpy as np

from ..errors import ConfigError, ResumeMismatchError
from .base import check_state
from .cut_source import cut_view
from .read import ReaderState, ShardReader
from .runs import DocRun
from .window import Window
from .window_order import window_key, window_order, window_size
from .window_reads import Pending, doc_views, locate, read_records

# tools/bench_plan_scale.py times these two under their old names
from .window_order import nonempty_order as _nonempty_order  # noqa: E402, F401
from .window_order import window_records as _window_records  # noqa: E402, F401

__all__ = ["DocRun", "ShuffleBuffer", "window_size"]



class ShuffleState(TypedDict):
    """A saved ``ShuffleBuffer`` cursor: the reader's cursor at the start of window ``window``,
    and, when that window is ``loaded``, the document ``pos`` of its order and ``token_offset``
    tokens into it."""

    reader: ReaderState
    window: int
    loaded: bool
    pos: int
    token_offset: int


STATE_KEYS: tuple[str, ...] = tuple(ShuffleState.__annotations__)  # the keys of a saved state


class BufferCursor(NamedTuple):
    """A saved ``ShuffleBuffer`` cursor, read by ``ShuffleBuffer.saved_cursor``."""

    reader: ReaderState
    window: int
    loaded: bool
    pos: int
    token_offset: int

_EMPTY = np.zeros(0, np.uint8)  # a record the source skipped as damaged
_WHOLE = 1 << 62  # a token budget no document reaches


class ShuffleBuffer:
    """One stream's documents in a seeded window shuffle: the second stage of a worker's
    pipeline. Implements the stage contract (``stages.base.Stage``): ``next()`` is the rest
    of the current document as a one-document ``DocRun``; the interleaver pulls with
    ``remaining``/``take``/``take_run`` and looks ahead with ``known_lengths``.

    Args:
        source: the stream's ``ShardReader`` (its state is saved under ``"reader"``).
        size: documents in a window once warmed up (>= 1).
        seed: the run's seed.
        stream_key: the stream's name (part of each window's key, and of messages).
        global_worker: the worker's number among all ranks' workers (part of the key).
        eos_id: the token appended after each document, or None.
        windows_for: pass -> the saved windows' rests this worker emits before window 0 of
            that pass (elastic resume; none by default).
        generation: statistical resumes so far; each reshuffles the windows.
        warmup: documents in window 0 of a pass, doubling per window up to ``size``; 0 for
            full windows from the start.

    Raises:
        ConfigError: ``size`` < 1 or ``warmup`` < 0.
    """

    def __init__(
        self,
        source: ShardReader,
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
            raise ConfigError(f"shuffle buffer size must be >= 1, got {size}")
        if warmup < 0:
            raise ConfigError(f"shuffle warm-up must be >= 0, got {warmup}")
        self.source = source
        self.size = size
        self.warmup = warmup
        self.seed = seed
        self.stream_key = stream_key
        self.global_worker = global_worker
        self.eos_id = eos_id
        self.windows_for = windows_for or (lambda pass_idx: [])
        self.generation = int(generation)
        self._window_start: ReaderState = source.state_dict()
        self.window_idx = self._first_window(source.pass_idx)  # within the pass: loaded or next
        self._clear()

    def window_size(self, window: int | None = None) -> int:
        """Documents in window ``window`` of a pass (the current one by default)."""
        return window_size(self.size, self.warmup, self.window_idx if window is None else window)

    def window_key(self) -> int:
        """The permutation key of the current window."""
        return window_key(self.seed, self.stream_key, self.source.pass_idx, self.global_worker,
                          self.window_idx, self.generation)

    def saved_window(self, pass_idx: int, window: int) -> dict:
        """The saved window's rest emitted as window ``window`` (< 0) of ``pass_idx``."""
        return self.windows_for(pass_idx)[window - self._first_window(pass_idx)]

    def unit_source(self, unit: dict):
        """The shards a saved window's rest is read from: through its own ``trims`` where it
        holds pieces of documents cut between workers (``resume/cut_work.py``)."""
        trims = {(int(s), int(r)): (int(lo), int(hi)) for s, r, lo, hi in unit.get("trims", ())}
        return cut_view(self.source.source, trims)

    def _first_window(self, pass_idx: int) -> int:
        """-k when the pass starts with k saved windows' rests, else 0."""
        return -len(self.windows_for(pass_idx))

    def _fill_prelude(self, skip: int | None) -> bool:
        """Lay out the current saved window's rest (``skip``: a restore's position)."""
        item = self.saved_window(self.source.pass_idx, self.window_idx)
        if not self._fill(int(item["pos"]) if skip is None else skip, unit=item):
            return False
        if skip is None:
            self.token_offset = int(item["offset"])
        return True

    def _clear(self) -> None:
        self.loaded = False
        self._window: Window | None = None
        self.pos = 0
        self.token_offset = 0

    # -- windows ---------------------------------------------------------------------------
    def _load(self) -> bool:
        """Load the next non-empty window; False when a finite stream is exhausted."""
        reader = self.source
        while True:
            if self.window_idx < 0:
                self._window_start = reader.state_dict()
                if self._fill_prelude(skip=None):
                    return True
                self.window_idx += 1
                continue
            if reader.pass_done:
                if not reader.next_pass():
                    self._window_start = reader.state_dict()
                    return False
                self.window_idx = self._first_window(reader.pass_idx)
                continue
            self._window_start = reader.state_dict()
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
        reader, shards = self.source, self.source.source if unit is None else self.unit_source(unit)
        size = self.window_size()
        ranges = reader.peek_ranges(size) if reading else [tuple(r) for r in unit["ranges"]]
        if reading and skip == 0:
            reader.announce()  # indexes and frames start coming while the window is laid out
        shard, record, lengths, order = window_order(shards, ranges, self.window_key() if reading else int(unit["key"]))
        if not reading and unit.get("stop") is not None:  # a piece of a window's rest: its order ends there
            order = order[: int(unit["stop"])]
        if len(order) == 0:
            if reading:
                reader.skip(len(record))
            return False
        if not 0 <= skip < len(order):
            raise ResumeMismatchError(
                f"ShuffleBuffer({self.stream_key}): saved position {skip} is outside window "
                f"{self.window_idx} of {len(order)} documents"
            )
        wanted = order[skip:]
        cut = shards.pieces(shard, record) if hasattr(shards, "pieces") else None
        lens = lengths[order].copy()
        lens[:skip] = 0
        # a restore reads its frames as its documents leave; where damaged records may be
        # skipped it reads them all first, since one left out changes the window's layout
        if (skip > 0 or not reading) and shards.on_error == "raise":
            pending = Pending(shards, ranges, shard[wanted], record[wanted], skip)
            self._lay_out(Window(order, lens, shard, record, None, shards.dtype, skip, self.eos_id, pending, cut), skip)
            if reading:
                reader.skip(len(record))
            return True
        if skip == 0 and reading:
            docs = reader.read(size)
        else:
            docs = read_records(shards, shard[np.sort(wanted)], record[np.sort(wanted)], ranges)
            if reading:
                reader.skip(len(record))
        if skip == 0 and len(docs) == len(record):  # every record came back, in window order
            if docs.spans is not None:  # no object per document (``Window``)
                window = Window(order, lens, shard, record, None, shards.dtype, 0, self.eos_id, cut=cut,
                                spans=docs.spans.take(wanted))
                self._lay_out(window, skip)
                return True
            views = doc_views(docs)
            pieces = [views[i] for i in wanted.tolist()]
        else:
            views = doc_views(docs)
            at, present = locate(docs.shard, docs.record, shard[wanted], record[wanted])
            # a record the source skipped as damaged (on_error="skip") is laid out empty
            empty = _EMPTY.view(shards.dtype)
            pieces = [views[i] if ok else empty for i, ok in zip(at.tolist(), present.tolist())]
            lens[skip:] = [len(p) for p in pieces]
        self._lay_out(Window(order, lens, shard, record, pieces, shards.dtype, skip, self.eos_id, cut=cut), skip)
        return True

    def _lay_out(self, window: Window, skip: int) -> None:
        """Make ``window`` the current one, its first ``skip`` documents handed on already."""
        self._window = window
        self.loaded = True
        self.pos = skip
        self.token_offset = 0
        self._skip_empty()

    def _skip_empty(self) -> None:
        """Step over documents laid out empty (damaged records skipped by the source)."""
        offsets, n = self._window.offsets, self._window.num_docs
        while self.pos < n and offsets[self.pos + 1] == offsets[self.pos]:
            self.pos += 1
        if self.pos == n:
            self._finish_window()

    def _finish_window(self) -> None:
        self._clear()
        self.window_idx += 1
        self._window_start = self.source.state_dict()

    # -- consumer API ----------------------------------------------------------------------
    def remaining(self) -> int | None:
        """Tokens left in the current document (loading a window if needed); None at the end."""
        if not self.loaded and not self._load():
            return None
        return self._window.length(self.pos) - self.token_offset

    def doc_length(self) -> int:
        """Full length of the current document (call after ``remaining()``)."""
        return self._window.length(self.pos)

    def peek_token(self) -> int:
        window = self._window
        window.ensure(self.pos + 1)
        if self.token_offset < window.doc_tokens(self.pos):
            return window.token(self.pos, self.token_offset)
        return self.eos_id

    def take(self, n: int) -> tuple[np.ndarray, int, int, int, bool]:
        """Up to ``n`` tokens of the current document: (tokens, shard, record, token_start, done).

        Call ``remaining()`` first; it guarantees a current document.
        """
        window, pos, token_offset = self._window, self.pos, self.token_offset
        window.ensure(pos + 1)
        k = min(n, window.length(pos) - token_offset)
        parts = window.cut(pos, token_offset, token_offset + k)
        piece = parts[0] if len(parts) == 1 else np.concatenate(parts)
        done = token_offset + k == window.length(pos)
        if done:
            self._advance(1)
        else:
            self.token_offset += k
        start = token_offset + (0 if window.base is None else int(window.base[pos]))
        return piece, window.shards[pos], window.records[pos], start, done

    def known_lengths(self, max_docs: int) -> np.ndarray | None:
        """Full lengths of the current document and of up to ``max_docs - 1`` after it, all in
        the loaded window; None where no window is loaded or the window holds documents laid
        out empty (skipped records), which the consumer then takes one run at a time."""
        if not self.loaded or self._window.has_empty:
            return None
        return self._window.lengths[self.pos : min(self.pos + max_docs, self._window.num_docs)]

    def upcoming_lengths(self, max_docs: int) -> np.ndarray:
        """Full lengths of the documents after the current one, within this window."""
        lo = self.pos + 1
        return self._window.lengths[lo : min(lo + max_docs, self._window.num_docs)]

    def take_run(self, n: int, max_docs: int) -> DocRun:
        """Up to ``n`` tokens from at most ``max_docs`` consecutive documents, the current one
        first; only the last may be cut short (``Window.run``)."""
        window = self._window
        run, docs, stop = window.run(self.pos, self.token_offset, n, max_docs)
        self._move_past(docs, stop, run.done)
        return run

    def take_block(self, ext, stream: int, grid: np.ndarray) -> tuple[dict, bool, int] | None:
        """A whole batch of the loaded window in one compiled call (``Window.block``), as
        ``take_run`` would take it: ``(pieces, done, tokens of the documents begun after the
        current one)``; None where the window cannot give it."""
        if not self.loaded:
            return None
        window = self._window
        got = window.block(ext, self.pos, self.token_offset, stream, grid)
        if got is None:
            return None
        pieces, docs, stop, done = got
        offsets, pos = window.offsets, self.pos
        begun = offsets[pos + docs] - offsets[pos + 1] if docs > 1 else 0
        self._move_past(docs, stop, done)
        return pieces, done, begun

    def _move_past(self, docs: int, stop: int, done: bool) -> None:
        """The cursor after a run of ``docs`` documents begun that stops at window offset
        ``stop``: past all of them where the last one is ``done``, else inside the last."""
        if done:
            self._advance(docs)
        else:
            self._advance(docs - 1)
            self.token_offset = stop - self._window.offsets[self.pos]

    def _advance(self, docs: int) -> None:
        if docs == 0:
            return
        self.pos += docs
        self.token_offset = 0
        self._skip_empty()

    def pending_records(self) -> list[tuple[int, int]]:
        """(shard, record) of documents read from the reader but not yet fully emitted."""
        if not self.loaded:
            return []
        return list(zip(self._window.shards[self.pos :], self._window.records[self.pos :]))

    def seek(self, pass_idx: int, records: int) -> None:
        """Start at a window boundary ``records`` records into this worker's ``pass_idx``
        (``WorkerPipeline.seek``, for a statistical resume)."""
        self._clear()
        self.source.seek(pass_idx, records)
        self._window_start = self.source.state_dict()
        self.window_idx = 0

    # -- stage contract --------------------------------------------------------------------
    def __iter__(self) -> ShuffleBuffer:
        return self

    def __next__(self) -> DocRun:
        """The rest of the current document (all of it, unless a restore began it)."""
        if self.remaining() is None:
            raise StopIteration
        return self.take_run(_WHOLE, 1)

    def close(self) -> None:
        self._clear()
        self.source.close()

    def state_dict(self) -> ShuffleState:
        return {
            "reader": self._window_start.copy(),
            "window": self.window_idx,
            "loaded": self.loaded,
            "pos": self.pos,
            "token_offset": self.token_offset,
        }

    @staticmethod
    def saved_cursor(state: ShuffleState) -> BufferCursor:
        """The fields of a saved state, as ints and a bool (the reader's cursor as saved, see
        ``ShardReader.saved_cursor``); ``ResumeMismatchError`` if it lacks a key."""
        check_state(state, STATE_KEYS, "ShuffleBuffer")
        return BufferCursor(state["reader"], int(state["window"]), bool(state["loaded"]), int(state["pos"]),
                            int(state["token_offset"]))

    def check_state(self, state: ShuffleState) -> None:
        """Raise ``ResumeMismatchError`` unless ``state`` points into this worker's data:
        reader cursor in its ranges, position inside the window, token offset inside the
        document (reads record indexes only, never tokens; leaves this buffer unusable)."""
        check_state(state, STATE_KEYS, "ShuffleBuffer")
        self.source.load_state_dict(state["reader"])
        where = f"ShuffleBuffer({self.stream_key})"
        self.window_idx = int(state["window"])
        pos, token_offset = int(state["pos"]), int(state["token_offset"])
        if self.window_idx < self._first_window(self.source.pass_idx) or pos < 0 or token_offset < 0:
            raise ResumeMismatchError(
                f"{where}: window {self.window_idx}, pos {pos}, token_offset {token_offset}: none may be negative"
            )
        if not state["loaded"]:
            return
        if self.window_idx < 0:
            item = self.saved_window(self.source.pass_idx, self.window_idx)
            if pos < int(item["pos"]):
                raise ResumeMismatchError(f"{where}: pos {pos} is before where resumed window "
                                          f"{self.window_idx} starts ({item['pos']})")
            if item.get("stop") is not None and pos >= int(item["stop"]):
                raise ResumeMismatchError(f"{where}: pos {pos} is past where resumed window "
                                          f"{self.window_idx}, a piece of a window's rest, ends ({item['stop']})")
            return
        shard, record, lengths, order = window_order(
            self.source.source, self.source.peek_ranges(self.window_size()), self.window_key(), keep=True
        )
        if pos >= len(order):
            raise ResumeMismatchError(f"{where}: pos {pos} is outside window {self.window_idx} of {len(order)} documents")
        length = int(lengths[order[pos]]) + (self.eos_id is not None)
        if token_offset >= length:
            raise ResumeMismatchError(
                f"{where}: token_offset {token_offset} is outside document (shard {int(shard[order[pos]])}, "
                f"record {int(record[order[pos]])}) of {length} tokens"
            )

    def load_state_dict(self, state: ShuffleState) -> None:
        check_state(state, STATE_KEYS, "ShuffleBuffer")
        self._clear()
        self.source.load_state_dict(state["reader"])
        self._window_start = self.source.state_dict()
        self.window_idx = int(state["window"])
        if self.window_idx < self._first_window(self.source.pass_idx):
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
