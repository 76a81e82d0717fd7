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

from ..errors import ResumeMismatchError, ShardCorruptError
from ..planning.rng import splitmix64_keys
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
    _check_rest(dataset, stream, unit, tokens)
    if not full:
        return RestDocs(tokens, None, None, None, None, None)
    start, hi = np.zeros(len(tokens), np.int64), np.zeros(len(tokens), np.int64)
    for (s, r), (lo, end) in trims.items():
        at = np.flatnonzero((shard == s) & (record == r))
        start[at], hi[at] = lo, end
    if len(start):
        start[0] += offset
    return RestDocs(tokens, shard, record, start, hi, eos)


def _check_rest(dataset, stream: int, unit: dict, tokens: np.ndarray) -> None:
    """``ResumeMismatchError`` where ``tokens`` (``rest_docs``) do not hold the saved rest."""
    pos, offset = int(unit["pos"]), int(unit["offset"])
    where = (f"loader state: stream {dataset.planner.names[stream]!r}: a saved window's rest "
             f"(ranges {unit['ranges']}, key {unit['key']}, pos {pos})")
    if len(tokens) != int(unit["docs"]):
        raise ResumeMismatchError(f"{where} holds {len(tokens)} documents in its shard indexes, not the {unit['docs']} "
                                  "saved")
    if len(tokens) and tokens[0] <= 0:
        raise ResumeMismatchError(f"{where}: offset {offset} is not inside its first document "
                                  f"({int(tokens[0]) + offset} tokens)")


def unit_doc_tokens(dataset, stream: int, unit: dict) -> np.ndarray:
    """The tokens of each document a window's rest holds, in its emission order (``rest_docs``)."""
    return rest_docs(dataset, stream, unit, full=False).tokens


def units_doc_tokens(dataset, stream: int, units: list[dict]) -> list[np.ndarray]:
    """``unit_doc_tokens`` of each of ``units`` (windows' rests of stream ``stream``), the
    same arrays, computed together: an elastic re-plan splits thousands of rests, and one
    window's order at a time costs more in calls than in sorting.

    Rests without trims are batched: their records' lengths gathered from the shard indexes
    at once, their windows' hashes computed at once (``rng.splitmix64_keys``), and each window
    sorted as a row of keys: a document's hash with its low bits replaced by its tokens. Where
    no two of a window's hashes agree above those bits, the sorted row is the order a stable
    sort of the hashes gives (``rng.permutation``) and holds the documents' tokens; a window
    where two do (about once in 2**(64 - 2 * 9 - bits) windows of 512 documents, ``bits`` those
    of the largest document's tokens) is ordered one at a time, as are rests with trims,
    sources that cut records or skip damaged indexes, and saved values out of range.
    """
    out: list = [None] * len(units)
    source = dataset._index_source(stream)
    eos = bool(dataset.eos_appended[stream])
    lengths_of: dict = {}

    def batchable(unit: dict) -> bool:
        if unit.get("trims") or hasattr(source, "pieces") or getattr(source, "on_error", None) == "skip":
            return False
        stop = int(unit.get("stop", 0))
        if not (0 <= int(unit["pos"]) < 2**62 and 0 <= stop < 2**62 and abs(int(unit["offset"])) < 2**62
                and 0 <= int(unit["key"]) < 2**64):
            return False
        for s, a, b in unit["ranges"]:
            s, a, b = int(s), int(a), int(b)
            if s not in lengths_of:
                try:
                    lengths_of[s] = np.asarray(source.index(s).records["num_tokens"])
                except ShardCorruptError:
                    lengths_of[s] = None
            if lengths_of[s] is None or not 0 <= a <= b <= len(lengths_of[s]):
                return False
        return True

    fast = [j for j, u in enumerate(units) if batchable(u)]
    if fast:
        _batch_doc_tokens([units[j] for j in fast], lengths_of, eos, fast, out)
    for j, unit in enumerate(units):
        if out[j] is None:
            out[j] = unit_doc_tokens(dataset, stream, unit)
        elif len(out[j]) != int(unit["docs"]) or (len(out[j]) and out[j][0] <= 0):
            _check_rest(dataset, stream, unit, out[j])
    return out


def _batch_doc_tokens(units: list[dict], lengths_of: dict, eos: bool, where: list[int], out: list) -> None:
    """``units_doc_tokens`` of ``units`` (batchable there) into ``out[where[i]]``; a rest
    whose window's hashes agree above the bits replaced is left None."""
    per_unit = [[lengths_of[int(s)][int(a):int(b)] for s, a, b in u["ranges"]] for u in units]
    count = np.array([sum(len(x) for x in parts) for parts in per_unit], np.int64)
    lengths = np.concatenate([x for parts in per_unit for x in parts] or [np.zeros(0, np.int64)]).astype(np.int64)
    keep = lengths > 0  # every window's records, window after window: its documents
    kept = np.concatenate([[0], np.cumsum(keep)])
    ends = np.cumsum(count)
    n = kept[ends] - kept[ends - count]  # each window's documents
    lengths = lengths[keep] + (1 if eos else 0)
    bits = int(lengths.max()).bit_length() if len(lengths) else 0
    if bits > 40:  # too few of a hash's bits left to order by: one window at a time
        return
    starts = np.cumsum(n) - n
    col = np.arange(len(lengths), dtype=np.int64) - np.repeat(starts, n)  # a document's index in its window
    keyed = splitmix64_keys(col, np.repeat(np.array([int(u["key"]) for u in units], np.uint64), n))
    low = np.uint64((1 << bits) - 1)  # a key's low bits: the document's tokens
    keyed &= ~low
    keyed |= lengths.astype(np.uint64)
    widths = np.array([max(int(x) - 1, 0).bit_length() for x in n.tolist()], np.int64)
    poss = np.array([int(u["pos"]) for u in units], np.int64)
    stops = np.array([int(u.get("stop", 2**62)) for u in units], np.int64)  # no stop: the window's end
    offsets = np.array([int(u["offset"]) for u in units], np.int64)
    for width in np.unique(1 << widths).tolist():  # rows of up to ``width`` documents, a few MB at a time
        group = np.flatnonzero(1 << widths == width)
        for rows in np.array_split(group, -(-len(group) * width // _BATCH_CELLS)):
            cnt = n[rows]
            at = _runs(starts[rows], cnt)  # the rows' documents, row after row
            real = np.arange(width) < cnt[:, None]  # a row's first cnt cells: its documents
            table = np.full((len(rows), width), np.uint64(2**64 - 1), np.uint64)  # after any document
            table[real] = keyed[at]
            table.sort(axis=1)
            high = table >> np.uint64(bits)
            tied = ((high[:, 1:] == high[:, :-1]) & real[:, 1:]).any(axis=1)
            # each rest's documents: its window's order from pos to stop, the first less offset
            hi = np.minimum(stops[rows], cnt)
            lo = np.minimum(poss[rows], hi)
            size = np.where(tied, 0, hi - lo)
            cells = np.arange(width)
            took = (table[(cells >= lo[:, None]) & (cells < (lo + size)[:, None])] & low).astype(np.int64)
            ends = np.cumsum(size)
            took[(ends - size)[size > 0]] -= offsets[rows][size > 0]
            for i, tokens, bad in zip(rows.tolist(), np.split(took, ends[:-1]), tied.tolist()):
                if not bad:
                    out[where[i]] = tokens


_BATCH_CELLS = 1 << 20  # documents (with padding) ordered at once by ``_batch_doc_tokens``


def _runs(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``first[k], first[k] + 1, ..., first[k] + count[k] - 1`` for each k, in one array."""
    ends = np.cumsum(count)
    total = int(ends[-1]) if len(ends) else 0
    return np.arange(total, dtype=np.int64) + np.repeat(first - (ends - count), count)


def doc_part(docs: RestDocs, d: int, t0: int, t1: int) -> dict:
    """Tokens ``t0..t1-1`` of document ``d`` of a window's rest (``docs``: ``rest_docs``), its
    EOS with them where ``t1`` is its end, as a window's rest of its own: the one record, read
    through trims naming the part (``resume/cut_work.py``), as token cuts read theirs."""
    s, r, start = int(docs.shard[d]), int(docs.record[d]), int(docs.start[d])
    end = int(docs.tokens[d])
    hi = int(docs.hi[d]) if t1 >= end else start + t1
    return {"ranges": [[s, r, r + 1]], "key": 0, "pos": 0, "offset": 0, "tokens": t1 - t0, "docs": 1,
            "trims": [[s, r, start + t0, hi]]}


def rest_piece(unit: dict, tokens: np.ndarray, a: int, b: int, held: int | None = None) -> dict:
    """Documents ``a..b-1`` of a window's rest ``unit`` (``tokens``: each one's) as a window's
    rest of its own: its order from ``pos + a`` to ``stop``, the rest's ``offset`` into its
    first document only where that is the rest's first (``held``: their tokens, where the
    caller has summed them)."""
    out = dict(unit)
    out["pos"] = int(unit["pos"]) + a
    out["offset"] = int(unit["offset"]) if a == 0 else 0
    if b < len(tokens) or "stop" in unit:
        out["stop"] = int(unit["pos"]) + b
    out["tokens"], out["docs"] = int(tokens[a:b].sum()) if held is None else held, b - a
    return out
