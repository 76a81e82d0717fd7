"""What a saved shuffle-buffer state says about its worker's progress, from record indexes only.

Resume code asks these questions of saved states; a running pipeline never does, so they live
here, as functions over a stage's saved state and its public methods:

* ``reader_position`` / ``buffer_position``: how many records a saved cursor had handed on
  (statistical resume);
* ``buffer_work_left``: the record ranges and shuffle windows' rests a saved worker had not
  handed out (elastic resume);
* ``rest_docs`` / ``rest_piece`` / ``doc_part``: the documents of a window's rest, a
  consecutive piece of them as a rest of its own, and a part of one document as one (an
  elastic re-plan deals a rest over several workers).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ..errors import ResumeMismatchError
from ..planning.plan import Range
from ..stages.cut_source import cut_view
from ..stages.read import ReaderState, ShardReader
from ..stages.shuffle import ShuffleBuffer, ShuffleState
from ..stages.window_order import window_order
from .cut_work import unit_trims, view_trims


def reader_position(state: ReaderState, ranges: list[Range]) -> int:
    """Records of ``ranges`` before the saved ``ShardReader`` cursor ``state``."""
    cursor = ShardReader.saved_cursor(state)
    done = ranges[: cursor.range_idx]
    return sum(b - a for _, a, b in done) + cursor.offset


def buffer_position(state: ShuffleState, ranges_for: Callable[[int], list[Range]]) -> tuple[int, int]:
    """(pass, records handed on) of a saved ``ShuffleBuffer`` state: the reader cursor at the
    window start plus the documents of the window already emitted (the window's empty records
    are not counted there, so this is approximate by at most those)."""
    cursor = ShuffleBuffer.saved_cursor(state)
    pass_idx = ShardReader.saved_cursor(cursor.reader).pass_idx
    records = reader_position(cursor.reader, ranges_for(pass_idx))
    return pass_idx, records + (cursor.pos if cursor.loaded else 0)


def buffer_work_left(buffer: ShuffleBuffer, state: ShuffleState) -> tuple[int, list, list[dict]]:
    """What the worker of a saved ``ShuffleBuffer`` state had not handed on, from record
    indexes only: (pass, record ranges not yet read, windows' rests ``{"ranges", "key", "pos",
    "offset", "tokens", "docs"}``: its current window's and those of its saved windows not yet
    emitted).

    ``buffer`` is configured as the saved worker's was; it is left unusable.
    """
    buffer.check_state(state)
    reader = buffer.source
    pass_idx = reader.pass_idx
    cursor = ShuffleBuffer.saved_cursor(state)
    loaded, pos, offset = cursor.loaded, cursor.pos, cursor.token_offset
    units: list[dict] = []
    if buffer.window_idx < 0:
        for window in range(buffer.window_idx, 0):
            current = loaded and window == buffer.window_idx
            item = buffer.saved_window(pass_idx, window)
            units.append(_window_rest(buffer, item["ranges"], int(item["key"]), pos if current else int(item["pos"]),
                                      offset if current else int(item["offset"]), buffer.unit_source(item),
                                      item.get("stop")))
    elif loaded:
        ranges = reader.peek_ranges(buffer.window_size())
        units.append(_window_rest(buffer, ranges, buffer.window_key(), pos, offset, reader.source))
        reader.skip(sum(b - a for _, a, b in ranges))
    return pass_idx, reader.unread(), [u for u in units if u["docs"]]


def _window_rest(buffer: ShuffleBuffer, ranges, key: int, pos: int, offset: int, source, stop=None) -> dict:
    """A saved window's rest, with the tokens and documents it still holds (and the trims of
    the documents in it that token cuts share with other workers: ``resume/cut_work.py``); a
    piece of a window's rest (``stop``: its emission order ends there) stays one."""
    lengths = rest_tokens(source, ranges, key, pos, stop, offset, buffer.eos_id is not None)
    out = {"ranges": [[int(s), int(a), int(b)] for s, a, b in ranges], "key": int(key), "pos": pos,
           "offset": offset, "tokens": int(lengths.sum()), "docs": len(lengths)}
    if stop is not None:
        out["stop"] = int(stop)
    trims = unit_trims(view_trims(source), ranges)
    if trims:
        out["trims"] = trims
    return out


def rest_tokens(source, ranges, key: int, pos: int, stop: int | None, offset: int, eos: bool) -> np.ndarray:
    """The tokens (EOS included) of each document a window's rest still holds, in emission
    order: documents ``pos..stop`` of the window's order (to its end without ``stop``), the
    first less the ``offset`` tokens of it already handed out. ``source`` is the stream's
    shards as the window reads them (through its trims, where it has some)."""
    return _rest(source, ranges, key, pos, stop, offset, eos)[0]


def _rest(source, ranges, key: int, pos: int, stop: int | None, offset: int, eos: bool) -> tuple:
    """``rest_tokens``, with the documents' shards and records and whether an EOS follows each."""
    shard, record, lengths, order = window_order(source, ranges, key)
    order = order[pos:stop]
    shard, record = shard[order], record[order]
    out = lengths[order].astype(np.int64)
    ends = np.ones(len(order), bool)
    if hasattr(source, "pieces"):  # a piece a cut ends before its document does has no EOS
        ends = source.pieces(shard, record)[1]
    if eos:
        out = out + ends
    if len(out):
        out[0] -= offset
    return out, shard, record, ends & eos


class RestDocs(NamedTuple):
    """The documents a window's rest holds, in emission order: each one's tokens left (EOS
    included where one follows it), its record, its first token left in that record and the
    record's end as its trims say (0: the document's end), and whether an EOS follows it."""

    tokens: np.ndarray
    shard: np.ndarray
    record: np.ndarray
    start: np.ndarray
    hi: np.ndarray
    eos: np.ndarray


def rest_docs(dataset, stream: int, unit: dict, full: bool = True) -> RestDocs:
    """The documents of a window's rest ``unit`` of stream ``stream`` (its shard indexes
    through its own trims: ``rest_tokens``; ``full`` False: their tokens only, the rest
    None); ``ResumeMismatchError`` where they do not hold the rest's saved documents."""
    trims = {(int(s), int(r)): (int(lo), int(hi)) for s, r, lo, hi in unit.get("trims", ())}
    source = cut_view(dataset._index_source(stream), trims)
    stop, pos, offset = unit.get("stop"), int(unit["pos"]), int(unit["offset"])
    tokens, shard, record, eos = _rest(source, unit["ranges"], int(unit["key"]), pos,
                                       None if stop is None else int(stop), offset, bool(dataset.eos_appended[stream]))
    where = (f"loader state: stream {dataset.planner.names[stream]!r}: a saved window's rest "
             f"(ranges {unit['ranges']}, key {unit['key']}, pos {pos})")
    if len(tokens) != int(unit["docs"]):
        raise ResumeMismatchError(f"{where} holds {len(tokens)} documents in its shard indexes, not the {unit['docs']} "
                                  "saved")
    if len(tokens) and tokens[0] <= 0:
        raise ResumeMismatchError(f"{where}: offset {offset} is not inside its first document "
                                  f"({int(tokens[0]) + offset} tokens)")
    if not full:
        return RestDocs(tokens, None, None, None, None, None)
    start, hi = np.zeros(len(tokens), np.int64), np.zeros(len(tokens), np.int64)
    for (s, r), (lo, end) in trims.items():
        at = np.flatnonzero((shard == s) & (record == r))
        start[at], hi[at] = lo, end
    if len(start):
        start[0] += offset
    return RestDocs(tokens, shard, record, start, hi, eos)


def unit_doc_tokens(dataset, stream: int, unit: dict) -> np.ndarray:
    """The tokens of each document a window's rest holds, in its emission order (``rest_docs``)."""
    return rest_docs(dataset, stream, unit, full=False).tokens


def doc_part(docs: RestDocs, d: int, t0: int, t1: int) -> dict:
    """Tokens ``t0..t1-1`` of document ``d`` of a window's rest (``docs``: ``rest_docs``), its
    EOS with them where ``t1`` is its end, as a window's rest of its own: the one record, read
    through trims naming the part (``resume/cut_work.py``), as token cuts read theirs."""
    s, r, start = int(docs.shard[d]), int(docs.record[d]), int(docs.start[d])
    end = int(docs.tokens[d])
    hi = int(docs.hi[d]) if t1 >= end else start + t1
    return {"ranges": [[s, r, r + 1]], "key": 0, "pos": 0, "offset": 0, "tokens": t1 - t0, "docs": 1,
            "trims": [[s, r, start + t0, hi]]}


def rest_piece(unit: dict, tokens: np.ndarray, a: int, b: int) -> dict:
    """Documents ``a..b-1`` of a window's rest ``unit`` (``tokens``: each one's) as a window's
    rest of its own: its order from ``pos + a`` to ``stop``, the rest's ``offset`` into its
    first document only where that is the rest's first."""
    out = dict(unit)
    out["pos"] = int(unit["pos"]) + a
    out["offset"] = int(unit["offset"]) if a == 0 else 0
    if b < len(tokens) or "stop" in unit:
        out["stop"] = int(unit["pos"]) + b
    out["tokens"], out["docs"] = int(tokens[a:b].sum()), b - a
    return out
