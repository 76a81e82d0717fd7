"""The compact form of a batch, and its expansion into the batch contract.

A worker sends ``RowBatch``: token ids in their storage dtype, shape [R, T+1] (column T holds
the token that follows the row, for the last label), and one small record per document piece
(row, start, length, stream, shard, record, token_start, continues). About 2 bytes per token
cross the process boundary instead of the ~30 of the expanded int64/int32/int16 tensors.

``expand`` derives the contract (docs/batch.md) in the consumer process, vectorized over the
whole batch: labels shifted exactly once, here; positions restart at 0 at every piece start;
doc ids number the pieces of a row from 0, -1 on padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass
class RowBatch:
    tokens: np.ndarray  # [R, T+1] storage dtype; padding holds pad_id
    lookahead: np.ndarray  # [R] bool: tokens[:, T] is the token after the row in the stream
    row: np.ndarray  # [P] int32, pieces sorted by (row, start)
    start: np.ndarray  # [P] int32 position in the row
    length: np.ndarray  # [P] int32
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


_ARANGE = np.arange(0, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    global _ARANGE
    if len(_ARANGE) < n:
        _ARANGE = np.arange(max(n, 2 * len(_ARANGE)), dtype=np.int64)
    return _ARANGE[:n]


def expand(batch: RowBatch, *, boundary: str = "document", provenance: bool = False) -> dict[str, torch.Tensor]:
    """The full batch contract from a ``RowBatch`` (numpy work, then zero-copy to torch)."""
    rows, width = batch.tokens.shape
    seq_len = width - 1
    size = rows * seq_len
    input_ids = np.empty((rows, seq_len), np.int64)
    input_ids[...] = batch.tokens[:, :seq_len]
    labels = np.empty((rows, seq_len), np.int64)
    labels[...] = batch.tokens[:, 1:]
    lengths = batch.length
    flat_start = batch.row.astype(np.int64) * seq_len + batch.start
    local = _arange(len(lengths)) - np.searchsorted(batch.row, batch.row, side="left")
    total = int(lengths.sum())
    piece_begin = np.repeat(flat_start, lengths)
    if total == size:  # no padding: every position belongs to a piece, in order
        positions = _arange(size) - piece_begin
        doc_ids = np.repeat(local.astype(np.int32), lengths)
        source_ids = np.repeat(batch.stream, lengths)
        padding = None
    else:
        index = np.repeat(flat_start - (np.cumsum(lengths) - lengths), lengths) + _arange(total)
        positions = np.zeros(size, np.int64)
        positions[index] = index - piece_begin
        doc_ids = np.full(size, -1, np.int32)
        doc_ids[index] = np.repeat(local.astype(np.int32), lengths)
        source_ids = np.full(size, -1, np.int16)
        source_ids[index] = np.repeat(batch.stream, lengths)
        padding = doc_ids < 0
    last = flat_start + lengths - 1
    flat_labels = labels.reshape(-1)
    ends = ~batch.continues
    if boundary == "document":
        flat_labels[last[ends]] = IGNORE_INDEX
    else:
        # Labels run across documents, except into padding or past an unknown lookahead.
        at_row_end = batch.start.astype(np.int64) + lengths == seq_len
        nxt = np.minimum(last + 1, size - 1)
        into_padding = ~at_row_end & (padding[nxt] if padding is not None else False)
        no_lookahead = at_row_end & ~batch.lookahead[batch.row]
        flat_labels[last[ends & (into_padding | no_lookahead)]] = IGNORE_INDEX
    if padding is not None:
        flat_labels[padding] = IGNORE_INDEX
    out = {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(positions.reshape(rows, seq_len)),
        "doc_ids": torch.from_numpy(doc_ids.reshape(rows, seq_len)),
        "source_ids": torch.from_numpy(source_ids.reshape(rows, seq_len)),
    }
    if provenance:
        out["segments"] = torch.from_numpy(segments(batch, local))
    return out


def segments(batch: RowBatch, local: np.ndarray | None = None) -> np.ndarray:
    """[R, S, 5] int64: (stream, shard, record, token_start, length) per piece, -1 padded."""
    rows = batch.num_rows
    if local is None:
        first_of_row = np.searchsorted(batch.row, batch.row, side="left")
        local = np.arange(len(batch.row)) - first_of_row
    width = int(local.max()) + 1 if len(local) else 1
    out = np.full((rows, width, 5), -1, np.int64)
    out[batch.row, local] = np.stack(
        [batch.stream, batch.shard, batch.record, batch.token_start, batch.length], axis=1
    )
    return out
