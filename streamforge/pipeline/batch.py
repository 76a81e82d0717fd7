"""The compact form of a batch, and its expansion into the batch contract.

A worker sends ``RowBatch``: token ids in their storage dtype, shape [R, T+1] (column T holds
the token that follows the row, for the last label), and one small record per document piece
laid out in the flattened batch (start, length, stream, shard, record, token_start,
continues); a piece may run over a row boundary (concat packing). About 2 bytes per token
cross the process boundary instead of the ~28 of the expanded int64/int32 tensors.

``expand`` derives the contract (docs/batch.md) in the consumer process, in one pass over the
batch by the compiled core where it is built (``core``), else vectorized with numpy (the
reference; both give the same tensors): labels shifted exactly once, here; positions restart
at 0 at every document and every row start; doc ids number the pieces of a row from 0, -1 on
padding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError
from . import core

IGNORE_INDEX = -100
FIELDS = ("input_ids", "labels", "position_ids", "doc_ids", "source_ids")  # the batch contract


def check_fields(fields) -> tuple[str, ...]:
    """``fields`` as a tuple of contract names (None: all of them; empty: none, for a rank that
    only keeps the clock, such as a middle pipeline stage); ``ConfigError`` naming an unknown one."""
    if fields is None:
        return FIELDS
    if isinstance(fields, str):
        fields = (fields,)
    fields = tuple(dict.fromkeys(str(f) for f in fields))
    unknown = [f for f in fields if f not in FIELDS]
    if unknown:
        raise ConfigError(f"fields must name some of {', '.join(FIELDS)}; got {list(fields)!r}"
                          + (f" ({', '.join(map(repr, unknown))} unknown)" if unknown else ""))
    return fields


@dataclass
class RowBatch:
    tokens: np.ndarray  # [R, T+1] storage dtype; padding holds pad_id
    lookahead: np.ndarray  # [R] bool: tokens[:, T] is the token after the row in the stream
    start: np.ndarray  # [P] int64 position in the flattened [R*T] batch, increasing
    length: np.ndarray  # [P] int64
    stream: np.ndarray  # [P] int16
    shard: np.ndarray  # [P] int32
    record: np.ndarray  # [P] int64 record index within the shard
    token_start: np.ndarray  # [P] int64 offset of the piece in its document
    continues: np.ndarray  # [P] bool: the document goes on after the piece

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def num_tokens(self) -> int:
        return int(self.length.sum())

    def nbytes(self) -> int:
        return sum(getattr(self, f).nbytes for f in self.__dataclass_fields__)


def padding_rows(num_rows: int, seq_len: int, dtype: np.dtype, pad_id: int, out: np.ndarray | None = None) -> np.ndarray:
    """``[num_rows, seq_len + 1]`` tokens of padding to build rows in: ``out`` (a worker's ring
    slot) filled with ``pad_id``, or a new array."""
    if out is None:
        return np.full((num_rows, seq_len + 1), pad_id, dtype)
    out.fill(pad_id)
    return out


def pad_to_rows(batch: RowBatch | None, num_rows: int, seq_len: int, dtype: np.dtype, pad_id: int) -> RowBatch:
    """``batch`` with padding rows appended up to ``num_rows`` (a whole batch of padding
    when None): no pieces, labels -100, doc ids -1, as everywhere else padding is."""
    tokens = padding_rows(num_rows, seq_len, dtype, pad_id)
    lookahead = np.zeros(num_rows, bool)
    if batch is None:
        z = np.zeros(0, np.int64)
        return RowBatch(tokens, lookahead, z, z, z.astype(np.int16), z.astype(np.int32), z, z, z.astype(bool))
    n = batch.num_rows
    tokens[:n] = batch.tokens
    lookahead[:n] = batch.lookahead
    return RowBatch(tokens, lookahead, batch.start, batch.length, batch.stream, batch.shard,
                    batch.record, batch.token_start, batch.continues)


_ARANGE = np.arange(0, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    global _ARANGE
    if len(_ARANGE) < n:
        _ARANGE = np.arange(max(n, 2 * len(_ARANGE)), dtype=np.int64)
    return _ARANGE[:n]


def _tiled_fields(batch: RowBatch, rows: int, seq_len: int, want=FIELDS) -> tuple:
    """Positions, doc ids and source ids of a batch without padding. The pieces are first cut
    at row starts into segments (a few dozen), whose fields are constants or ramps: one
    ``np.repeat`` per field over the batch instead of two or three. Every step on the
    segments is one numpy call on a few dozen values (np.diff and list-built arrays cost more
    than the work here), and a single-stream batch fills its source ids without a repeat."""
    size = rows * seq_len
    row_starts = _arange(rows) * seq_len
    cuts = np.concatenate((batch.start, row_starts))
    cuts.sort()
    new = np.empty(len(cuts), bool)
    new[0] = True
    np.not_equal(cuts[1:], cuts[:-1], out=new[1:])
    seg = cuts[new]
    n = len(seg)
    seg_len = np.empty(n, np.int64)
    np.subtract(seg[1:], seg[:-1], out=seg_len[:-1])
    seg_len[-1] = size - seg[-1]
    positions = doc_ids = source_ids = None
    if "position_ids" in want:
        positions = np.repeat(seg, seg_len)
        np.subtract(_arange(size), positions, out=positions)
    if "doc_ids" in want:
        row_first = np.searchsorted(seg, row_starts)  # every row starts a segment
        doc_ids = np.repeat((_arange(n) - row_first[seg // seq_len]).astype(np.int32), seg_len)
    if "source_ids" in want:
        stream = batch.stream
        streams = set(stream.tolist())  # a few dozen pieces: cheaper than a numpy reduction
        if len(streams) == 1:
            source_ids = np.full(size, streams.pop(), np.int32)
        else:
            piece = np.searchsorted(batch.start, seg, side="right") - 1
            source_ids = np.repeat(stream[piece].astype(np.int32), seg_len)
    return positions, doc_ids, source_ids


def expand(
    batch: RowBatch, *, boundary: str = "document", provenance: bool = False, fields: tuple[str, ...] = FIELDS,
) -> dict[str, torch.Tensor]:
    """The batch contract from a ``RowBatch`` (arrays filled by the compiled core or by numpy,
    then zero-copy to torch): the tensors named in ``fields`` (all five by default), each
    computed only when asked for, and the provenance ``segments`` with ``provenance``."""
    if not fields and not provenance:
        return {}
    out = None
    if fields and core.ext is not None:
        out = _expand_compiled(core.ext, batch, boundary, fields)
    if out is None:
        out = _expand_numpy(batch, boundary, fields) if fields else {}
    if provenance:
        out["segments"] = torch.from_numpy(segments(batch))
    return out


_INT32 = ("doc_ids", "source_ids")  # int32, not int16: gloo and NCCL broadcast them


def _expand_compiled(ext, batch: RowBatch, boundary: str, fields: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
    """``fields`` filled by the compiled core in one pass; None for a layout it leaves to numpy."""
    rows, width = batch.tokens.shape
    shape = (rows, width - 1)
    empty = np.empty
    arrays = [None if dtype is None else empty(shape, dtype) for dtype in _wanted(tuple(fields))]
    if not ext.expand(batch.tokens, batch.lookahead, batch.start, batch.length, batch.stream, batch.continues,
                      boundary == "document", *arrays):
        return None
    from_numpy = torch.from_numpy
    return {name: from_numpy(values) for name, values in zip(FIELDS, arrays) if values is not None}


@functools.lru_cache(maxsize=64)
def _wanted(fields: tuple[str, ...]) -> tuple[type | None, ...]:
    """The dtype of each of the five contract fields, None where ``fields`` leaves it out."""
    return tuple((np.int32 if name in _INT32 else np.int64) if name in fields else None for name in FIELDS)


def _expand_numpy(batch: RowBatch, boundary: str, fields: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``fields`` computed with numpy, vectorized over the batch: the reference."""
    rows, width = batch.tokens.shape
    seq_len = width - 1
    size = rows * seq_len
    out: dict[str, torch.Tensor] = {}
    if "input_ids" in fields:
        input_ids = np.empty((rows, seq_len), np.int64)
        input_ids[...] = batch.tokens[:, :seq_len]
        out["input_ids"] = torch.from_numpy(input_ids)
    lengths = batch.length
    if int(lengths.sum()) == size:  # no padding: the pieces tile the batch, in order
        positions, doc_ids, source_ids = _tiled_fields(batch, rows, seq_len, fields)
        padding = None
    else:
        starts = batch.start
        ends = starts + lengths
        # the first piece touching each row: doc ids count pieces from it
        first_piece = np.searchsorted(ends, _arange(rows) * seq_len, side="right")
        piece_ids = np.repeat(_arange(len(lengths)), lengths)
        total = len(piece_ids)
        index = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + _arange(total)
        row_of = index // seq_len
        begin = np.maximum(np.repeat(starts, lengths), row_of * seq_len)
        positions = np.zeros(size, np.int64)
        positions[index] = index - begin
        doc_ids = np.full(size, -1, np.int32)
        doc_ids[index] = piece_ids - first_piece[row_of]
        source_ids = np.full(size, -1, np.int32)  # int32, not int16: gloo and NCCL broadcast it
        source_ids[index] = np.repeat(batch.stream, lengths)
        padding = doc_ids < 0
    if "labels" in fields:
        out["labels"] = torch.from_numpy(_labels(batch, boundary, padding))
    for name, values in (("position_ids", positions), ("doc_ids", doc_ids), ("source_ids", source_ids)):
        if name in fields:
            out[name] = torch.from_numpy(values.reshape(rows, seq_len))
    return out


def _labels(batch: RowBatch, boundary: str, padding: np.ndarray | None) -> np.ndarray:
    """[R, T] int64 labels: the next token, -100 where the contract says nothing follows."""
    rows, width = batch.tokens.shape
    seq_len = width - 1
    size = rows * seq_len
    labels = np.empty((rows, seq_len), np.int64)
    labels[...] = batch.tokens[:, 1:]
    ends = batch.start + batch.length
    last = ends - 1
    flat_labels = labels.reshape(-1)
    done = ~batch.continues
    if boundary == "document":
        flat_labels[last[done]] = IGNORE_INDEX
    else:
        # Labels run across documents, except into padding or past an unknown lookahead.
        at_row_end = ends % seq_len == 0
        nxt = np.minimum(ends, size - 1)
        into_padding = ~at_row_end & (padding[nxt] if padding is not None else False)
        no_lookahead = at_row_end & ~batch.lookahead[last // seq_len]
        flat_labels[last[done & (into_padding | no_lookahead)]] = IGNORE_INDEX
    if padding is not None:
        flat_labels[padding] = IGNORE_INDEX
    return labels


def split_at_rows(batch: RowBatch) -> dict[str, np.ndarray]:
    """The batch's pieces cut at every row boundary: one entry per (document, row) piece."""
    seq_len = batch.seq_len
    starts, lengths = batch.start, batch.length
    ends = starts + lengths
    if len(starts) == 0:
        z = np.zeros(0, np.int64)
        return {"row": z, "col": z, "length": z, "stream": z, "shard": z, "record": z,
                "token_start": z, "continues": np.zeros(0, bool)}
    cuts = np.arange(seq_len, int(ends[-1]), seq_len)
    holder = np.searchsorted(ends, cuts, side="right")
    inner = holder < len(starts)
    cuts, holder = cuts[inner], holder[inner]
    inner = starts[holder] < cuts
    cuts = cuts[inner]
    seg_start = np.sort(np.concatenate([starts, cuts]))
    piece = np.searchsorted(ends, seg_start, side="right")
    seg_end = np.minimum(ends[piece], (seg_start // seq_len + 1) * seq_len)
    last_seg = seg_end == ends[piece]
    return {
        "row": seg_start // seq_len,
        "col": seg_start % seq_len,
        "length": seg_end - seg_start,
        "stream": batch.stream[piece],
        "shard": batch.shard[piece],
        "record": batch.record[piece],
        "token_start": batch.token_start[piece] + (seg_start - starts[piece]),
        "continues": np.where(last_seg, batch.continues[piece], True),
    }


def segments(batch: RowBatch) -> np.ndarray:
    """[R, S, 5] int64: (stream, shard, record, token_start, length) per piece, -1 padded."""
    pieces = split_at_rows(batch)
    row = pieces["row"]
    local = np.arange(len(row)) - np.searchsorted(row, row, side="left")
    width = int(local.max()) + 1 if len(local) else 1
    out = np.full((batch.num_rows, width, 5), -1, np.int64)
    out[row, local] = np.stack(
        [pieces["stream"], pieces["shard"], pieces["record"], pieces["token_start"], pieces["length"]], axis=1
    )
    return out
