"""Balanced packing (``packing="balance"``): every row costs about the same attention work.

With document masks a row's attention work is ``sum(L_i ** 2)`` over its document pieces
(``pipeline/cost.py``). Data-parallel ranks wait for the slowest one at every step, so rows
(and batches) of equal tokens but unequal cost make stragglers. This packer builds rows that
all aim at one cost, the same on every rank, with nothing exchanged between ranks:

* the *target* (``layout_balance.balance_target``) is computed once per job from a fixed
  sample of the corpus's record lengths (the record indexes of up to ``SAMPLE_SHARDS`` shards
  per stream, spread over the stream) and the mixture's first weights: every rank computes
  the same value;
* a worker takes a *window* of the next ``WINDOW_ROWS * seq_len`` tokens from the interleaver,
  exactly as concat packing would take them for that many rows (a document that runs past
  the window's end carries into the next window, as concat's carry does), and lays them out
  in rows of ``seq_len`` tokens whose costs are near the target (``layout_balance.lay_out``):
  documents whose pieces are too long for the target are cut into near-equal parts, and a
  part is cut where a row ends;
* each document's parts in a window are numbered so that a row before another holds the
  earlier tokens of a document (the cost depends on lengths only), and a part cut where its
  row ends carries the next token as the row's look-ahead, so its last label is kept; a part
  cut inside a row (a long document's part followed by another document) ends with label -100.

Every row is full (the last row of a finite pass is padded). Every token of the window is in
exactly one row. The state is the interleaver's state at the window start and the number of
the window's rows handed out (``PackerState``, as bestfit's): restoring takes the same window
again and lays it out the same way.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from ..errors import ConfigError, ResumeMismatchError
from ..pipeline import core
from ..pipeline.batch import RowBatch, padding_rows
from .base import check_state
from .interleave import Interleaver
from .layout_balance import balance_target, lay_out
from .pack import STATE_KEYS, PackerState, _join_runs

WINDOW_ROWS = 64  # rows laid out together
SAMPLE_SHARDS = 16  # shards per stream whose record lengths set the target


def corpus_target(dataset: Any, seq_len: int) -> float:
    """The row cost of ``dataset``'s balanced packing at ``seq_len``: from the record lengths
    of up to ``SAMPLE_SHARDS`` shards per stream (evenly spaced over its shards, in order)
    and the mixture's first weights (``balance_target``)."""
    lengths, shares = [], []
    weights = dataset.schedule.weights[0]
    for i, manifest in enumerate(dataset.read_manifests):
        shards = manifest.num_shards
        picked = sorted({int(k) for k in np.linspace(0, shards - 1, min(shards, SAMPLE_SHARDS))}) if shards else []
        got = dataset.planner.record_lengths(i, picked, eos=dataset.eos_appended[i]) if picked else []
        lengths.append(np.concatenate(got) if got else np.zeros(0, np.int64))
        shares.append(float(weights[i]))
    return balance_target(lengths, shares, seq_len, WINDOW_ROWS)


def balanced_target(dataset: Any) -> float | None:
    """The row cost ``dataset``'s balanced packing aims at (None in other packings); it
    takes one row length (its target is per length): a seq_len schedule is a ``ConfigError``."""
    if dataset.config.packing != "balance":
        return None
    if dataset.seq_lens.constant is None:
        raise ConfigError("packing='balance' takes one seq_len (an int), not a schedule: its cost target is "
                          "computed for one row length")
    return corpus_target(dataset, dataset.seq_lens.constant)


class BalancedPacker:
    """Documents in, rows of equal attention cost out (see the module docstring). The same
    interface as ``pack.Packer``: ``next_rows``, ``state_dict``/``load_state_dict``,
    ``check_state``, ``source_state``, ``set_seq_len``, ``close``.

    Args:
        source: the ``Interleaver`` the documents come from.
        seq_len: tokens in a row.
        target: the cost every row aims at (``corpus_target``).
        pad_id, dtype: as ``Packer``'s.
        window_rows: rows laid out together.
    """

    mode = "balance"

    def __init__(self, source: Interleaver, *, seq_len: int, target: float, pad_id: int = 0,
                 dtype: np.dtype = np.dtype("<u2"), window_rows: int = WINDOW_ROWS) -> None:
        if not target > 0:
            raise ConfigError(f"balanced packing: the cost target must be > 0, got {target!r}")
        self.source = source
        self.seq_len = int(seq_len)
        self.target = float(target)
        self.pad_id = pad_id
        self.dtype = dtype
        self.window_rows = int(window_rows)
        self.truncated_tokens = 0
        self._start: Any = None  # the interleaver's state at the window start
        self._flat: np.ndarray | None = None  # the window's tokens, as taken (and one look-ahead)
        self._buffer: np.ndarray | None = None  # where windows' tokens are taken to, reused
        self._rows = 0  # rows in the window
        self._src: np.ndarray | None = None  # per part: its first token in _flat
        self._at: np.ndarray | None = None  # per part and one more: its place in the window's rows (tokens before it)
        self._cols: tuple = ()  # per part: length, stream, shard, record, token_start, continues
        self._next: np.ndarray | None = None  # each row's look-ahead token (pad_id where none)
        self._lookahead: np.ndarray | None = None
        self._row_parts: np.ndarray | None = None  # where each row's parts begin
        self._emitted = 0
        self._end: Any = None  # the interleaver's state at the window end
        self._pieces: list = []  # the window's pieces, as saved (``state_dict``)

    # -- public ----------------------------------------------------------------------------
    def set_seq_len(self, seq_len: int) -> None:
        if seq_len != self.seq_len:
            raise ConfigError("packing='balance' takes one seq_len, not a schedule")

    def next_rows(self, num_rows: int, out: np.ndarray | None = None) -> RowBatch | None:
        """Up to ``num_rows`` rows (fewer only at the end of a finite pass); None when done."""
        T = self.seq_len
        ext = core.ext
        if ext is None:
            tokens = padding_rows(num_rows, T, self.dtype, self.pad_id, out)
        else:  # every token written below, padding where none is
            tokens = np.empty((num_rows, T + 1), self.dtype) if out is None else out
        lookahead = np.zeros(num_rows, bool)
        starts: list[np.ndarray] = []
        cols: list[list[np.ndarray]] = []
        count = written = 0
        while count < num_rows:
            if self._flat is None or self._emitted == self._rows:
                if not self._build_window():
                    break
            k = min(num_rows - count, self._rows - self._emitted)
            a, b = self._emitted, self._emitted + k
            lo, hi = int(self._row_parts[a]), int(self._row_parts[b])
            at, length = self._at, self._cols[0]
            # a window's parts, in row order, lie end to end in its rows (every row full but a short last one)
            if ext is None or ext.fill_parts(self._flat, self._src[lo:hi], length[lo:hi], tokens, count * T) is None:
                flat, shift = self._flat, count * T - a * T
                for src, place, n in zip(self._src[lo:hi].tolist(), at[lo:hi].tolist(), length[lo:hi].tolist()):
                    r, pos = divmod(place + shift, T)
                    tokens[r, pos : pos + n] = flat[src : src + n]
            written = count * T + int(at[hi] - at[lo])
            tokens[count : count + k, T] = self._next[a:b]
            lookahead[count : count + k] = self._lookahead[a:b]
            starts.append(at[lo:hi] + (count - a) * T)
            cols.append([c[lo:hi] for c in self._cols])
            self._emitted = b
            count += k
        if ext is not None and written < num_rows * T:  # padding after the last token written
            tokens[written // T, written % T :] = self.pad_id
            tokens[written // T + 1 :] = self.pad_id
        if count == 0:
            return None
        if len(starts) == 1:  # the usual case: one window's rows
            start, fields = starts[0], cols[0]
        else:
            start, fields = np.concatenate(starts), [np.concatenate(c) for c in zip(*cols)]
        length, stream, shard, record, token_start, continues = fields
        return RowBatch(tokens=tokens[:count], lookahead=lookahead[:count], start=start, length=length,
                        stream=stream, shard=shard, record=record, token_start=token_start, continues=continues)

    # -- the window ------------------------------------------------------------------------
    def _build_window(self) -> bool:
        """Take the next window's tokens and lay them out; False when the source is done."""
        self._start = self.source.state_dict()
        self._flat = None
        self._emitted = 0
        T = self.seq_len
        need = self.window_rows * T
        # the window's tokens go where the last window's were (nothing handed out refers to them)
        if self._buffer is None or len(self._buffer) != need + 1:
            self._buffer = np.empty(need + 1, self.dtype)
        flat = self._buffer
        grid = flat.reshape(1, -1) if core.ext is not None else None  # fill_rows' [1, need + 1] grid
        runs, filled = [], 0
        while filled < need:
            got = self.source.take_run(need - filled)
            if got is None:
                break
            stream, run = got
            if grid is None or run.copy_into_grid(core.ext, grid, filled) is None:
                run.copy_into(flat[filled : filled + run.size])
            run.release()
            runs.append((filled, stream, run))
            filled += run.size
        if filled == 0:
            return False
        pieces = _join_runs(runs)
        peek = self.source.peek_token() if filled == need and pieces["continues"][-1] else None
        flat[filled] = self.pad_id if peek is None else peek
        self._end = self.source.state_dict()
        self._pieces = np.stack([pieces["stream"].astype(np.int64), pieces["shard"].astype(np.int64),
                                 pieces["record"], pieces["token_start"], pieces["length"],
                                 pieces["continues"].astype(np.int64)], 1).tolist()
        self._lay_out(flat, pieces, filled, peek is not None)
        return True

    def _lay_out(self, flat: np.ndarray, pieces: dict[str, np.ndarray], filled: int, peeked: bool) -> None:
        T = self.seq_len
        # each piece's parts take its tokens in row order (the layout depends on lengths only)
        lay = lay_out(pieces["length"], T, self.target, in_row_order=True)
        row, piece, length, within = lay["row"], lay["piece"], lay["length"], lay["offset"]
        nrows = int(row[-1]) + 1
        row_first = np.searchsorted(row, np.arange(nrows + 1))
        # every row is full but a short last one: a part's place in the rows is the tokens before it
        at = np.zeros(len(row) + 1, np.int64)
        np.cumsum(length, out=at[1:])
        src = pieces["start"][piece] + within
        # a row's last part that stops inside its piece, or at the window's end inside its
        # document (the next token peeked): the next token is the look-ahead
        last = row_first[1:] - 1
        whose = piece[last]
        lookahead = (within[last] + length[last] < pieces["length"][whose]) | (pieces["continues"][whose] & peeked)
        self._next = np.where(lookahead, flat[src[last] + length[last]], self.pad_id).astype(self.dtype)
        continues = np.zeros(len(row), bool)
        continues[last[lookahead]] = True
        full = filled - (nrows - 1) * T
        if full < T:  # the end of a finite pass: the last row is short
            lookahead[-1] = False
            self._next[-1] = self.pad_id
            continues[last[-1]] = False
        self._flat, self._rows, self._lookahead = flat, nrows, lookahead
        self._row_parts, self._src, self._at = row_first, src, at
        self._cols = (length, pieces["stream"][piece], pieces["shard"][piece], pieces["record"][piece],
                      pieces["token_start"][piece] + within, continues)

    # -- stage contract --------------------------------------------------------------------
    def __iter__(self) -> BalancedPacker:
        return self

    def __next__(self) -> RowBatch:
        rows = self.next_rows(1)
        if rows is None:
            raise StopIteration
        return rows

    def close(self) -> None:
        self.source.close()

    def state_dict(self) -> PackerState:
        """The interleaver's state at the window start and the window's rows handed out; the
        window also says, for elastic resume, what it holds (``pieces``: ``[stream, shard,
        record, token_start, length, continues]`` each, in the order taken) and the interleaver's state
        at its end (``end``): ``window_rests`` turns them into work."""
        if self._flat is None or self._emitted == self._rows:
            return {"source": self.source.state_dict(), "window": None, "rows_emitted": 0}
        return {"source": self._start, "window": {"end": self._end, "pieces": self._pieces},
                "rows_emitted": self._emitted}

    @staticmethod
    def source_state(state: PackerState):
        check_state(state, STATE_KEYS, "Packer")
        return state["source"]

    def check_state(self, state: PackerState) -> None:
        self.check_state_keys(state)
        if int(state["rows_emitted"]) < 0:
            raise ResumeMismatchError(f"Packer: rows_emitted {state['rows_emitted']} is negative")
        self.source.check_state(state["source"])

    def load_state_dict(self, state: PackerState) -> None:
        self.check_state_keys(state)
        self.source.load_state_dict(state["source"])
        self._flat = None
        self._emitted = 0
        if state["window"]:
            self._build_window()
            rows = int(state["rows_emitted"])
            if self._flat is None or not 0 <= rows < self._rows:
                raise ResumeMismatchError(f"Packer: rows_emitted {rows} is outside the saved balanced window of "
                                          f"{0 if self._flat is None else self._rows} rows")
            self._emitted = rows

    @staticmethod
    def check_state_keys(state: PackerState) -> None:
        check_state(state, STATE_KEYS, "Packer")
        window = state["window"]
        if not (window is None or (isinstance(window, dict) and {"end", "pieces"} <= set(window))):
            raise ResumeMismatchError(f"Packer: window {str(window)[:80]} is not that of balanced packing")


def saved_end(state: PackerState):
    """The interleaver state a saved packer's work goes on from: the end of its open balanced
    window (whose rest ``window_rests`` adds), else its ``source``."""
    window = state.get("window") if isinstance(state, dict) else None
    if isinstance(window, dict) and "end" in window:
        return window["end"]
    return state["source"]


def window_rests(state: PackerState, seq_len: int, target: float, streams: int) -> tuple[Any, list[list[dict]]]:
    """What a saved packer's open balanced window had not handed out, for elastic resume
    (``resume/elastic.py``): ``(interleaver state, per stream shuffle-window rests)``.

    The window's rows handed out hold a prefix of each of its pieces (``lay_out`` is a
    function of the lengths, and a piece's parts take its tokens in row order), so each
    piece's rest is its record from a token on: one single-record rest per piece not wholly
    handed out. The window's last piece, when its document goes on past the window, is the
    document the interleaver's state at the window end is inside of: that state is returned
    with its stream's ``token_offset`` moved back to the piece's first token not handed out,
    so the document's rest is read once, from there. Without an open window: the saved
    ``source`` and no rests."""
    out: list[list[dict]] = [[] for _ in range(streams)]
    window = state.get("window") if isinstance(state, dict) else None
    if not isinstance(window, dict) or "pieces" not in window:
        return state["source"], out
    pieces = np.asarray(window["pieces"], np.int64).reshape(-1, 6)
    lay = lay_out(pieces[:, 4], seq_len, target)
    done = lay["row"] < int(state["rows_emitted"])
    given = np.bincount(lay["piece"][done], weights=lay["length"][done], minlength=len(pieces)).astype(np.int64)
    end = copy.deepcopy(window["end"])
    for i, ((stream, shard, record, token_start, length, continues), x) in enumerate(zip(pieces.tolist(),
                                                                                        given.tolist())):
        if i == len(pieces) - 1 and continues:
            end["sources"][stream]["token_offset"] = token_start + x
        elif x < length:
            out[stream].append({"ranges": [[shard, record, record + 1]], "key": 0, "pos": 0,
                                "offset": token_start + x, "tokens": length - x, "docs": 1})
    return end, out
