"""What a packed row costs to attend over, from its document ids.

With document masks a row's attention work grows with the squares of its document pieces'
lengths, not with its token count: one 8,192-token document costs 8,192² = 67M, 64 documents
of 128 tokens 64 × 128² = 1M. ``AttentionCost`` is that model, with two knobs:

* ``window``: a sliding-window attention caps what one token attends to, so a piece of
  length ``L`` costs ``L * min(L, window)``;
* ``linear``: a per-token term (the MLP and projections, in the same units), added as
  ``linear * L``.

Costs are in token-pairs (float64), computed from the ``doc_ids`` of the batch contract
(docs/batch.md: pieces numbered from 0 in every row, -1 on padding), so a cost is checkable
against any batch a trainer receives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError


@dataclass(frozen=True)
class AttentionCost:
    """The cost of a piece of ``L`` tokens: ``L * min(L, window) + linear * L``."""

    window: int | None = None
    linear: float = 0.0

    def __post_init__(self) -> None:
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            raise ConfigError(f"AttentionCost: window must be an integer >= 1 or None, got {self.window!r}")
        if not (isinstance(self.linear, (int, float)) and np.isfinite(self.linear) and self.linear >= 0):
            raise ConfigError(f"AttentionCost: linear must be a finite number >= 0, got {self.linear!r}")

    def pieces(self, lengths) -> np.ndarray:
        """The cost of each piece of ``lengths`` tokens."""
        length = np.asarray(lengths, np.float64)
        capped = length if self.window is None else np.minimum(length, float(self.window))
        return length * capped + self.linear * length

    def rows(self, doc_ids) -> np.ndarray:
        """The cost of each row of a ``[rows, seq_len]`` (or ``[seq_len]``) ``doc_ids``
        array or tensor: the pieces are the runs of one id in a row; padding (-1) is free."""
        ids = np.asarray(doc_ids.cpu() if hasattr(doc_ids, "cpu") else doc_ids)
        if ids.ndim == 1:
            ids = ids[None, :]
        rows, seq_len = ids.shape
        if rows == 0 or seq_len == 0:
            return np.zeros(rows, np.float64)
        flat = ids.reshape(-1)
        starts = np.ones(flat.shape, bool)
        starts[1:] = flat[1:] != flat[:-1]
        starts[::seq_len] = True  # a row always starts a piece
        at = np.flatnonzero(starts)
        length = np.diff(np.append(at, flat.size))
        cost = np.where(flat[at] >= 0, self.pieces(length), 0.0)
        return np.bincount(at // seq_len, weights=cost, minlength=rows)

    def batch(self, doc_ids) -> float:
        """The cost of a whole batch: the sum of its rows'."""
        return float(self.rows(doc_ids).sum())


def piece_row_costs(start, length, seq_len: int, rows: int, model: AttentionCost | None = None) -> np.ndarray:
    """The cost of each of ``rows`` rows of a packed batch from its pieces (``RowBatch.start``
    and ``.length``: offsets into the flattened ``[rows, seq_len]`` batch; a piece may run over
    row ends, where it is cut), without expanding ``doc_ids``: equal to ``model.rows(doc_ids)``."""
    model = model or AttentionCost()
    start = np.asarray(start, np.int64)
    end = start + np.asarray(length, np.int64)
    keep = end > start
    start, end = start[keep], end[keep]
    first, last = start // seq_len, (end - 1) // seq_len
    head = np.minimum(end, (first + 1) * seq_len) - start
    out = np.bincount(first, weights=model.pieces(head), minlength=rows)
    over = last > first
    if over.any():
        tail = end[over] - last[over] * seq_len
        out += np.bincount(last[over], weights=model.pieces(tail), minlength=rows)
        inner = last[over] - first[over] - 1
        if inner.any():
            full_rows = np.repeat(first[over] + 1, inner) + (
                np.arange(int(inner.sum())) - np.repeat(np.cumsum(inner) - inner, inner))
            out += np.bincount(full_rows, minlength=rows) * float(model.pieces([seq_len])[0])
    return out[:rows]
