"""A stream's shards as one worker sees them under token cuts (``planning/token_cuts.py``).

A record a cut falls in is read as the worker's piece of it: ``trims[(shard, record)] = (lo,
hi)`` keeps tokens ``[lo, hi)`` (``hi`` 0: to the end). The record index says so too (its
``num_tokens``), so a shuffle window's order and layout, a restore's reads and the planner's
counts all see the piece; ``pieces`` gives each piece's offset in its document (what the
ledger records) and whether it ends the document (only then does an EOS follow it).
Everything else is the wrapped source's.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..format.reader import DocBatch


class CutSource:
    """``source`` with the records in ``trims`` cut to their pieces."""

    def __init__(self, source, trims: dict[tuple[int, int], tuple[int, int]]) -> None:
        self.base = source
        self.trims = dict(trims)
        self._shards = {s for s, _ in self.trims}
        self._indexes: dict[int, object] = {}

    def __getattr__(self, name):
        return getattr(self.base, name)

    def _piece(self, shard: int, record: int, size: int) -> tuple[int, int]:
        lo, hi = self.trims[(shard, record)]
        return lo, (hi or size)

    def index(self, shard: int):
        index = self.base.index(shard)
        if shard not in self._shards:
            return index
        got = self._indexes.get(shard)
        if got is None or got[0] is not index:
            records = index.records.copy()
            total = int(index.num_tokens)
            for (s, r), _ in self.trims.items():
                if s == shard and r < len(records):
                    size = int(records["num_tokens"][r])
                    lo, hi = self._piece(s, r, size)
                    records["num_tokens"][r] = hi - lo
                    total -= size - (hi - lo)
            got = self._indexes[shard] = (index, replace(index, records=records, num_tokens=total))
        return got[1]

    def read(self, shard: int, start: int, stop: int) -> DocBatch:
        docs = self.base.read(shard, start, stop)
        if shard not in self._shards or not len(docs):
            return docs
        hit = [(r, t) for (s, r), t in self.trims.items() if s == shard and start <= r < stop]
        if not hit:
            return docs
        if docs.views is not None:
            views = list(docs.views)
        else:
            tokens = docs.tokens
            bounds = docs.offsets.tolist()
            views = [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        records = docs.record.tolist()
        for r, _ in hit:
            if r in records:
                i = records.index(r)
                lo, hi = self._piece(shard, r, len(views[i]))
                views[i] = views[i][lo:hi]
        lengths = np.array([len(v) for v in views], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return DocBatch(None, offsets, docs.shard, docs.record, views=views, dtype=docs.dtype)

    def pieces(self, shard: np.ndarray, record: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For records (arrays): each one's first token in its document, and whether an EOS
        may follow it (False for a piece a cut ends before the document does)."""
        base = np.zeros(len(shard), np.int64)
        ends = np.ones(len(shard), bool)
        for (s, r), (lo, hi) in self.trims.items():
            at = np.flatnonzero((shard == s) & (record == r))
            base[at] = lo
            ends[at] = hi == 0
        return base, ends


def cut_view(source, trims: dict) -> object:
    """``source`` seen through ``trims`` (itself where there are none)."""
    base = source.base if isinstance(source, CutSource) else source
    return CutSource(base, trims) if trims else base
