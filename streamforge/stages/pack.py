"""Packer: documents in, fixed-length rows out, as compact ``RowBatch`` es.

Modes:
  concat   documents (each ending in EOS) are laid end to end and cut every ``seq_len``
           tokens; the remainder of a document carries into the next row. No token is lost.
           The carry lives in the interleaver/shuffle cursor (a token offset into the
           current document), so this packer has no state of its own.
  bestfit  best-fit-decreasing over a window of documents: documents longer than a row are
           cut into full rows first, the remainders (and short documents) go, longest
           first, into the open row with the least room that fits them; rows are padded.
           A document is split only when longer than a row. State: the interleaver's state
           at the window start plus the number of the window's rows already emitted;
           restoring rebuilds the window deterministically.
  pad      one document per row, truncated (tokens past the row are dropped and counted)
           or padded.

The row length may change between batches (a ``seq_len`` schedule: the pipeline calls
``set_seq_len`` with the value of each batch's step). concat and pad need nothing more: the
document in progress is a cursor into the interleaver, whatever the row length. A bestfit
window with rows left at a switch is laid out again at the new length from what those rows
hold (each document's rest, whole again: ``_relayout``); nothing is dropped or repeated.
Its state then says how the window was laid out: ``window`` is ``[[seq_len, rows], ...]``,
the length it was built at (rows 0), then each new length and the rows of the layout before
it handed out when it changed (``window`` stays ``True`` for a packer whose length never
changes, as in states saved before schedules existed).
"""

from __future__ import annotations

import bisect
from typing import TypedDict

import numpy as np

from ..pipeline import core
from ..pipeline.batch import RowBatch, padding_rows
from ..errors import ConfigError, PipelineInvariantError, ResumeMismatchError
from .base import check_state
from .interleave import Interleaver, InterleaverState

_BIG = 1 << 62
MODES = ("concat", "bestfit", "pad")


class PackerState(TypedDict):
    """A saved ``Packer``: the interleaver's state (``source``), at the start of the bestfit
    window when ``window`` is set, with ``rows_emitted`` of that window's (latest layout's)
    rows handed out (``window`` None and ``rows_emitted`` 0 otherwise). ``window`` is True,
    or, for a packer whose row length changes, its layouts ``[[seq_len, rows], ...]``."""

    source: InterleaverState
    window: bool | list | None
    rows_emitted: int


STATE_KEYS: tuple[str, ...] = tuple(PackerState.__annotations__)  # the keys of a saved state


class _Rows:
    """Accumulates rows and their pieces, then freezes them into a RowBatch."""

    def __init__(self, num_rows: int, seq_len: int, dtype: np.dtype, pad_id: int, out: np.ndarray | None = None) -> None:
        self.tokens = padding_rows(num_rows, seq_len, dtype, pad_id, out)
        self.lookahead = np.zeros(num_rows, bool)
        self.pieces: list[tuple] = []
        self.count = 0

    def add_piece(self, row, start, tokens, stream, shard, record, token_start, continues) -> None:
        self.tokens[row, start : start + len(tokens)] = tokens
        self.pieces.append((row, start, len(tokens), stream, shard, record, token_start, continues))

    def freeze(self) -> RowBatch:
        n = self.count
        columns = list(zip(*self.pieces)) if self.pieces else [()] * len(_PIECE_FIELDS)
        arrays = {
            name: np.fromiter(values, dtype, len(values))
            for (name, dtype), values in zip(_PIECE_FIELDS.items(), columns)
        }
        row = arrays.pop("row")
        arrays["start"] = row * (self.tokens.shape[1] - 1) + arrays["start"]
        return RowBatch(tokens=self.tokens[:n], lookahead=self.lookahead[:n], **arrays)


_PIECE_FIELDS = {
    "row": np.int64, "start": np.int64, "length": np.int64, "stream": np.int16,
    "shard": np.int32, "record": np.int64, "token_start": np.int64, "continues": bool,
}


def _run_streams(stream: int, run) -> np.ndarray:
    """The stream of each piece of a run (a run of stream -1 mixes streams and says which)."""
    if stream < 0:
        return run.streams
    out = np.empty(len(run.length), np.int16)
    out.fill(stream)  # np.full costs three times as much on a few dozen values
    return out


def _starts(length: np.ndarray) -> np.ndarray:
    """Where each piece begins when they are laid end to end from 0 (int64). ``np.add.accumulate``
    is ``np.cumsum`` less the Python wrapper, a third of its cost on a batch's pieces."""
    ends = np.add.accumulate(length, dtype=np.int64)
    return np.subtract(ends, length, out=ends)


def _join_runs(runs) -> dict[str, np.ndarray]:
    """Piece arrays of runs laid end to end from position 0 of the flattened batch."""
    if len(runs) == 1:
        at, stream_idx, run = runs[0]
        length = run.length
        continues = np.zeros(len(length), bool)
        continues[-1] = not run.done
        return {
            "start": _starts(length), "length": length,
            "stream": _run_streams(stream_idx, run), "shard": run.shard.astype(np.int32),
            "record": run.record, "token_start": run.token_start, "continues": continues,
        }
    length = np.concatenate([r.length for _, _, r in runs])
    counts = [len(r.length) for _, _, r in runs]
    continues = np.zeros(len(length), bool)
    continues[np.cumsum(counts) - 1] = [not r.done for _, _, r in runs]
    if any(s < 0 for _, s, _ in runs):
        stream = np.concatenate([_run_streams(s, r) for _, s, r in runs])
    else:
        stream = np.repeat(np.array([s for _, s, _ in runs], np.int16), counts)
    return {
        "start": _starts(length), "length": length,
        "stream": stream,
        "shard": np.concatenate([r.shard for _, _, r in runs]).astype(np.int32),
        "record": np.concatenate([r.record for _, _, r in runs]),
        "token_start": np.concatenate([r.token_start for _, _, r in runs]),
        "continues": continues,
    }


class Packer:
    """Documents in, fixed-length rows out: the last stage of a worker's pipeline. Implements
    the stage contract (``stages.base.Stage``): ``next()`` is the next row as a one-row
    ``RowBatch``; the pipeline pulls whole batches with ``next_rows``.

    Args:
        source: the ``Interleaver`` the documents come from (its state is saved under
            ``"source"``).
        seq_len: tokens in a row (each row also carries one look-ahead token).
        mode: ``"concat"``, ``"bestfit"`` or ``"pad"`` (see the module docstring).
        pad_id: the token that fills the rest of a row.
        dtype: the token dtype of the rows.
        bestfit_window: documents packed together in ``"bestfit"`` mode.

    Raises:
        ConfigError: ``mode`` is not one of ``MODES``.
    """

    def __init__(
        self,
        source: Interleaver,
        *,
        seq_len: int,
        mode: str = "concat",
        pad_id: int = 0,
        dtype: np.dtype = np.dtype("<u2"),
        bestfit_window: int = 512,
        varies: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"packing must be one of {MODES}, got {mode!r}")
        self.source = source
        self.seq_len = seq_len
        self.mode = mode
        self.pad_id = pad_id
        self.dtype = dtype
        self.bestfit_window = bestfit_window
        self.truncated_tokens = 0
        # bestfit window: rows built from the documents taken since ``_window_start``
        self._window_start: InterleaverState | None = None
        self._window_rows: list | None = None
        self._rows_emitted = 0
        # the row length may change (``set_seq_len``): the bestfit window's layouts are saved
        self.varies = bool(varies)
        self._layouts: list[list[int]] = []  # [[seq_len, rows of the layout before], ...]

    # -- public ----------------------------------------------------------------------------
    def set_seq_len(self, seq_len: int) -> None:
        """Rows of ``seq_len`` tokens from the next batch on. A bestfit window with rows left
        is laid out again at the new length (``_relayout``)."""
        if seq_len == self.seq_len:
            return
        if not self.varies:
            raise ConfigError("packer: the row length changes only for a packer made with varies=True")
        self.seq_len = seq_len
        if self._window_rows is not None and self._rows_emitted < len(self._window_rows):
            self._relayout(seq_len)

    def next_rows(self, num_rows: int, out: np.ndarray | None = None) -> RowBatch | None:
        """Up to ``num_rows`` rows (fewer only at the end of a finite pass); None when done.
        ``out``: a ``[num_rows, seq_len + 1]`` array of the token dtype to build the rows'
        tokens in (a worker's ring slot); a batch it does not fit gets its own."""
        if self.mode == "concat":
            return self._concat_rows(num_rows, out)
        out = _Rows(num_rows, self.seq_len, self.dtype, self.pad_id, out)
        fill = {"bestfit": self._fill_bestfit, "pad": self._fill_pad}[self.mode]
        while out.count < num_rows and fill(out):
            out.count += 1
        if out.count == 0:
            return None
        return out.freeze()

    # -- concat ----------------------------------------------------------------------------
    def _concat_rows(self, num_rows: int, out: np.ndarray | None = None) -> RowBatch | None:
        """``num_rows`` rows cut from the token stream in one go: take ``num_rows * T``
        tokens as a few runs, then split the runs' pieces at row boundaries (vectorized). The
        compiled core writes the runs' tokens straight into the rows; numpy copies them into
        one flat array first, then into the rows (the reference; the same rows)."""
        if core.ext is None:
            return self._concat_rows_numpy(num_rows, out)
        ext = core.ext
        T = self.seq_len
        need = num_rows * T
        tokens = np.empty((num_rows, T + 1), self.dtype) if out is None else out
        pieces = self.source.take_block(ext, tokens)  # the whole batch from one window, in one call
        if pieces is not None:
            lookahead = np.empty(num_rows, bool)
            lookahead.fill(True)  # np.ones costs five times as much
            return RowBatch(tokens=tokens, lookahead=lookahead, **pieces)

        def place(run, filled: int) -> None:
            if run.copy_into_grid(ext, tokens, filled) != run.size:  # parts it does not take
                flat = np.empty(run.size, self.dtype)
                run.copy_into(flat)
                ext.fill_rows([flat], tokens, filled)

        runs, filled = self._take_runs(need, place)
        if filled == 0:
            return None
        if filled < need:  # the end of a finite pass: the rows it fills, then padding
            written = tokens
            rows, rest = divmod(filled, T)
            tokens = np.full((rows + (rest > 0), T + 1), self.pad_id, self.dtype)
            tokens[:rows, :T] = written[:rows, :T]
            if rest:
                tokens[rows, :rest] = written[rows, :rest]
        else:
            tokens[-1, T] = self.pad_id
        lookahead = self._row_ends(tokens, filled, need)
        return RowBatch(tokens=tokens, lookahead=lookahead, **_join_runs(runs))

    def _concat_rows_numpy(self, num_rows: int, out: np.ndarray | None = None) -> RowBatch | None:
        """``_concat_rows`` with numpy: the runs are copied into one flat array, then into the rows."""
        T = self.seq_len
        need = num_rows * T
        tokens = np.empty((num_rows, T + 1), self.dtype) if out is None else out
        tokens[:, T] = self.pad_id
        flat = tokens[:, :T].reshape(-1) if num_rows == 1 else np.empty(need, self.dtype)
        runs, filled = self._take_runs(need, lambda run, at: run.copy_into(flat[at : at + run.size]))
        if filled == 0:
            return None
        rows = -(-filled // T)
        if filled == need:
            if num_rows > 1:
                tokens[:, :T] = flat.reshape(num_rows, T)
        else:
            tokens = np.full((rows, T + 1), self.pad_id, self.dtype)
            grid = np.full(rows * T, self.pad_id, self.dtype)
            grid[:filled] = flat[:filled]
            tokens[:, :T] = grid.reshape(rows, T)
        lookahead = self._row_ends(tokens, filled, need)
        return RowBatch(tokens=tokens, lookahead=lookahead, **_join_runs(runs))

    def _take_runs(self, need: int, place) -> tuple[list, int]:
        """Runs of up to ``need`` tokens from the source, each put in place by ``place(run,
        offset)``: ``([(offset, stream, run), ...], tokens taken)``."""
        runs = []
        filled = 0
        while filled < need:
            got = self.source.take_run(need - filled)
            if got is None:
                break
            stream, run = got
            place(run, filled)
            # its tokens are copied: let go of its frames, or a window that ends mid-batch
            # keeps a dozen of them alive while the next window is read
            run.release()
            runs.append((filled, stream, run))
            filled += run.size
        return runs, filled

    def _row_ends(self, tokens: np.ndarray, filled: int, need: int) -> np.ndarray:
        """Column T of rows whose tokens are in place (it holds padding): the token after
        each row where it is known, the next row's first, and after the last row of a full
        batch the stream's next (``peek_token``); returns which rows have one."""
        T = self.seq_len
        rows = len(tokens)
        lookahead = np.zeros(rows, bool)
        nxt = min(filled // T, rows - 1)  # full rows followed by another row
        if nxt > 0:
            tokens[:nxt, T] = tokens[1 : nxt + 1, 0]
            lookahead[:nxt] = True
        if filled == need:
            peek = self.source.peek_token()
            if peek is not None:
                tokens[rows - 1, T] = peek
                lookahead[rows - 1] = True
        return lookahead

    # -- pad -------------------------------------------------------------------------------
    def _take_doc(self):
        """One whole document: (stream, tokens, shard, record) or None."""
        got = self.source.take(_BIG)
        if got is None:
            return None
        stream, tokens, shard, record, token_start, done = got
        if token_start != 0 or not done:
            raise ConfigError("packer: a document was left half-consumed by another packing mode")
        return stream, tokens, shard, record

    def _fill_pad(self, out: _Rows) -> bool:
        doc = self._take_doc()
        if doc is None:
            return False
        stream, tokens, shard, record = doc
        T, row = self.seq_len, out.count
        keep = tokens[:T]
        continues = len(tokens) > T
        out.add_piece(row, 0, keep, stream, shard, record, 0, continues)
        if continues:
            out.tokens[row, T] = tokens[T]
            out.lookahead[row] = True
            self.truncated_tokens += len(tokens) - T
        return True

    # -- bestfit ---------------------------------------------------------------------------
    def _fill_bestfit(self, out: _Rows) -> bool:
        if self._window_rows is None or self._rows_emitted == len(self._window_rows):
            if not self._build_window():
                return False
        pieces, lookahead = self._window_rows[self._rows_emitted]
        row = out.count
        pos = 0
        for stream, tokens, shard, record, token_start, continues in pieces:
            out.add_piece(row, pos, tokens, stream, shard, record, token_start, continues)
            pos += len(tokens)
        if lookahead is not None:
            out.tokens[row, self.seq_len] = lookahead
            out.lookahead[row] = True
        self._rows_emitted += 1
        return True

    def _build_window(self) -> bool:
        self._window_start = self.source.state_dict()
        self._rows_emitted = 0
        self._layouts = [[self.seq_len, 0]]
        docs = []
        for _ in range(self.bestfit_window):
            doc = self._take_doc()
            if doc is None:
                break
            stream, tokens, shard, record = doc
            docs.append((stream, tokens, shard, record, 0))
        self._window_rows = self._layout(docs, self.seq_len)
        return bool(self._window_rows)

    def _relayout(self, seq_len: int) -> None:
        """The window's rows not handed out yet, laid out again in rows of ``seq_len``: each
        document's pieces in them are its rest (its chunks come in rows before its remainder),
        joined again and packed as in ``_build_window``, in the order they first appear."""
        rests: dict[tuple, list] = {}
        for pieces, _ in self._window_rows[self._rows_emitted :]:
            for stream, tokens, shard, record, token_start, _continues in pieces:
                key = (stream, shard, record)
                if key not in rests:
                    rests[key] = [token_start, [tokens], token_start + len(tokens)]
                    continue
                rest = rests[key]
                if token_start != rest[2]:  # a document's pieces left are its rest, in order
                    raise PipelineInvariantError(f"packer: the bestfit window's pieces of record {record} of shard "
                                                 f"{shard} are not contiguous ({token_start} after {rest[2]})")
                rest[1].append(tokens)
                rest[2] += len(tokens)
        docs = [(stream, parts[0] if len(parts) == 1 else np.concatenate(parts), shard, record, start)
                for (stream, shard, record), (start, parts, _) in rests.items()]
        self._layouts.append([seq_len, self._rows_emitted])
        self._window_rows = self._layout(docs, seq_len)
        self._rows_emitted = 0

    @staticmethod
    def _layout(docs: list, T: int) -> list:
        """Best-fit-decreasing rows of ``T`` tokens for ``docs``, ``(stream, tokens, shard,
        record, token_start)`` each (a document's tokens from ``token_start`` to its end): each
        one's full rows first, in arrival order, then the remainders, longest first, each in
        the open row with the least room that fits it. A row is ``(pieces, lookahead)``."""
        rows: list = []
        remainders = []
        for arrival, (stream, tokens, shard, record, base) in enumerate(docs):
            full = len(tokens) // T
            for c in range(full):
                chunk = tokens[c * T : (c + 1) * T]
                more = (c + 1) * T < len(tokens)
                rows.append(([(stream, chunk, shard, record, base + c * T, more)],
                             int(tokens[(c + 1) * T]) if more else None))
            if len(tokens) % T:
                remainders.append((len(tokens) - full * T, arrival, stream, tokens[full * T :], shard, record,
                                   base + full * T))
        remainders.sort(key=lambda r: (-r[0], r[1]))
        open_rows: list[list] = []  # pieces per best-fit row
        free: list[tuple[int, int]] = []  # sorted (room, row number)
        for length, _, stream, tokens, shard, record, token_start in remainders:
            i = bisect.bisect_left(free, (length, -1))
            if i < len(free):
                room, r = free.pop(i)
            else:
                room, r = T, len(open_rows)
                open_rows.append([])
            open_rows[r].append((stream, tokens, shard, record, token_start, False))
            if room - length > 0:
                bisect.insort(free, (room - length, r))
        rows.extend((pieces, None) for pieces in open_rows)
        return rows

    # -- stage contract --------------------------------------------------------------------
    def __iter__(self) -> Packer:
        return self

    def __next__(self) -> RowBatch:
        """The next row (``next_rows(1)``)."""
        rows = self.next_rows(1)
        if rows is None:
            raise StopIteration
        return rows

    def close(self) -> None:
        self.source.close()

    def state_dict(self) -> PackerState:
        if self.mode != "bestfit" or self._window_rows is None or self._rows_emitted == len(self._window_rows):
            return {"source": self.source.state_dict(), "window": None, "rows_emitted": 0}
        window = [list(layout) for layout in self._layouts] if self.varies else True
        return {"source": self._window_start, "window": window, "rows_emitted": self._rows_emitted}

    @staticmethod
    def source_state(state: PackerState) -> InterleaverState:
        """The interleaver state nested in a saved state (at the bestfit window start)."""
        check_state(state, STATE_KEYS, "Packer")
        return state["source"]

    def check_state(self, state: PackerState) -> None:
        check_state(state, STATE_KEYS, "Packer")
        if int(state["rows_emitted"]) < 0:
            raise ResumeMismatchError(f"Packer: rows_emitted {state['rows_emitted']} is negative")
        self.source.check_state(state["source"])

    def _saved_layouts(self, window) -> list[list[int]]:
        """The layouts of a saved window (``True``: one, at this packer's row length)."""
        if window is True:
            return [[self.seq_len, 0]]
        ok = isinstance(window, list) and window and all(
            isinstance(x, list) and len(x) == 2 and all(type(v) is int and v >= 0 for v in x) for x in window)
        if not ok or window[0][1] != 0 or any(t < 1 for t, _ in window) or not self.varies:
            raise ResumeMismatchError(f"Packer: window {str(window)[:80]} is not [[seq_len, rows], ...] of a packer "
                                      "whose row length changes")
        return [list(x) for x in window]

    def load_state_dict(self, state: PackerState) -> None:
        check_state(state, STATE_KEYS, "Packer")
        self.source.load_state_dict(state["source"])
        self._window_rows = None
        self._rows_emitted = 0
        window = state["window"]
        if window:
            layouts = self._saved_layouts(window)
            self.seq_len = layouts[0][0]
            self._build_window()
            for seq_len, before in layouts[1:]:
                if not 0 <= before <= len(self._window_rows):
                    raise ResumeMismatchError(f"Packer: the saved window's layout at seq_len {seq_len} starts after "
                                              f"{before} rows, outside its {len(self._window_rows)} rows")
                self._rows_emitted = before
                self.seq_len = seq_len
                self._relayout(seq_len)
            rows = int(state["rows_emitted"])
            if not 0 <= rows < len(self._window_rows or ()):
                raise ResumeMismatchError(
                    f"Packer: rows_emitted {rows} is outside the saved bestfit window of "
                    f"{len(self._window_rows or ())} rows"
                )
            self._rows_emitted = rows
