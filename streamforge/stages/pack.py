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
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from ..batch import RowBatch
from .base import check_state
from .interleave import Interleaver

_BIG = 1 << 62
MODES = ("concat", "bestfit", "pad")


class _Rows:
    """Accumulates rows and their pieces, then freezes them into a RowBatch."""

    def __init__(self, num_rows: int, seq_len: int, dtype: np.dtype, pad_id: int) -> None:
        self.tokens = np.full((num_rows, seq_len + 1), pad_id, dtype)
        self.lookahead = np.zeros(num_rows, bool)
        self.pieces: list[tuple] = []
        self.count = 0

    def add_piece(self, row, start, tokens, stream, shard, record, token_start, continues) -> None:
        self.tokens[row, start : start + len(tokens)] = tokens
        self.pieces.append((row, start, len(tokens), stream, shard, record, token_start, continues))

    def freeze(self) -> RowBatch:
        n = self.count
        p = self.pieces
        cols = list(zip(*p)) if p else [()] * 8

        def col(i, dtype):
            return np.fromiter(cols[i], dtype, len(p))

        return RowBatch(
            tokens=self.tokens[:n],
            lookahead=self.lookahead[:n],
            row=col(0, np.int32),
            start=col(1, np.int32),
            length=col(2, np.int32),
            stream=col(3, np.int16),
            shard=col(4, np.int32),
            record=col(5, np.int64),
            token_start=col(6, np.int64),
            continues=col(7, bool),
        )


class Packer:
    def __init__(
        self,
        interleaver: Interleaver,
        *,
        seq_len: int,
        mode: str = "concat",
        pad_id: int = 0,
        dtype: np.dtype = np.dtype("<u2"),
        bestfit_window: int = 512,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"packing must be one of {MODES}, got {mode!r}")
        self.interleaver = interleaver
        self.seq_len = seq_len
        self.mode = mode
        self.pad_id = pad_id
        self.dtype = dtype
        self.bestfit_window = bestfit_window
        self.truncated_tokens = 0
        # bestfit window: rows built from the documents taken since ``_window_start``
        self._window_start: dict | None = None
        self._window_rows: list | None = None
        self._rows_emitted = 0

    # -- public ----------------------------------------------------------------------------
    def next_rows(self, num_rows: int) -> RowBatch | None:
        """Up to ``num_rows`` rows (fewer only at the end of a finite pass); None when done."""
        out = _Rows(num_rows, self.seq_len, self.dtype, self.pad_id)
        fill = {"concat": self._fill_concat, "bestfit": self._fill_bestfit, "pad": self._fill_pad}[self.mode]
        while out.count < num_rows and fill(out):
            out.count += 1
        if out.count == 0:
            return None
        return out.freeze()

    # -- concat ----------------------------------------------------------------------------
    def _fill_concat(self, out: _Rows) -> bool:
        row, pos, T = out.count, 0, self.seq_len
        inter = self.interleaver
        while pos < T:
            got = inter.take(T - pos)
            if got is None:
                break
            stream, tokens, shard, record, token_start, done = got
            out.add_piece(row, pos, tokens, stream, shard, record, token_start, not done)
            pos += len(tokens)
        if pos == 0:
            return False
        if pos == T:
            nxt = inter.peek_token()
            if nxt is not None:
                out.tokens[row, T] = nxt
                out.lookahead[row] = True
        return True

    # -- pad -------------------------------------------------------------------------------
    def _take_doc(self):
        """One whole document: (stream, tokens, shard, record) or None."""
        got = self.interleaver.take(_BIG)
        if got is None:
            return None
        stream, tokens, shard, record, token_start, done = got
        if token_start != 0 or not done:
            raise ValueError("packer: a document was left half-consumed by another packing mode")
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
        self._window_start = self.interleaver.state_dict()
        self._rows_emitted = 0
        T = self.seq_len
        rows: list = []
        remainders = []
        for arrival in range(self.bestfit_window):
            doc = self._take_doc()
            if doc is None:
                break
            stream, tokens, shard, record = doc
            full = len(tokens) // T
            for c in range(full):
                chunk = tokens[c * T : (c + 1) * T]
                more = (c + 1) * T < len(tokens)
                rows.append(([(stream, chunk, shard, record, c * T, more)],
                             int(tokens[(c + 1) * T]) if more else None))
            if len(tokens) % T:
                remainders.append((len(tokens) - full * T, arrival, stream, tokens[full * T :], shard, record, full * T))
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
        self._window_rows = rows
        return bool(rows)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.mode != "bestfit" or self._window_rows is None or self._rows_emitted == len(self._window_rows):
            return {"source": self.interleaver.state_dict(), "window": None, "rows_emitted": 0}
        return {"source": self._window_start, "window": True, "rows_emitted": self._rows_emitted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, ("source", "window", "rows_emitted"), "Packer")
        self.interleaver.load_state_dict(state["source"])
        self._window_rows = None
        self._rows_emitted = 0
        if state["window"]:
            self._build_window()
            self._rows_emitted = int(state["rows_emitted"])
