"""What a saved shuffle-buffer state says about its worker's progress, from record indexes only.

Resume code asks these questions of saved states; a running pipeline never does, so they live
here, as functions over a stage's saved state and its public methods:

* ``reader_position`` / ``buffer_position``: how many records a saved cursor had handed on
  (statistical resume);
* ``buffer_work_left``: the record ranges and shuffle windows' rests a saved worker had not
  handed out (elastic resume).
"""

from __future__ import annotations

from typing import Callable

from ..planning.plan import Range
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
                                      offset if current else int(item["offset"]), buffer.unit_source(item)))
    elif loaded:
        ranges = reader.peek_ranges(buffer.window_size())
        units.append(_window_rest(buffer, ranges, buffer.window_key(), pos, offset, reader.source))
        reader.skip(sum(b - a for _, a, b in ranges))
    return pass_idx, reader.unread(), [u for u in units if u["docs"]]


def _window_rest(buffer: ShuffleBuffer, ranges, key: int, pos: int, offset: int, source) -> dict:
    """A saved window's rest, with the tokens and documents it still holds (and the trims of
    the documents in it that token cuts share with other workers: ``resume/cut_work.py``)."""
    _, _, lengths, order = window_order(source, ranges, key)
    order = order[pos:]
    eos = buffer.eos_id is not None
    if eos and hasattr(source, "pieces"):  # a piece a cut ends before its document does has no EOS
        shard, record, _, _ = window_order(source, ranges, key)
        ends = source.pieces(shard[order], record[order])[1]
        tokens = int(lengths[order].sum()) + int(ends.sum()) - offset
    else:
        tokens = int(lengths[order].sum()) + (len(order) if eos else 0) - offset
    out = {"ranges": [[int(s), int(a), int(b)] for s, a, b in ranges], "key": int(key), "pos": pos,
           "offset": offset, "tokens": tokens, "docs": len(order)}
    trims = unit_trims(view_trims(source), ranges)
    if trims:
        out["trims"] = trims
    return out
