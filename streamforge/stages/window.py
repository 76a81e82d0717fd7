"""Window: one shuffle window laid out in emission order, as the buffer hands it out.

No token is copied: each document stays a view of the frame it was decoded into, and the
window is ``offsets`` into their virtual concatenation, an EOS after each. A run is copied
once, by its consumer, straight from the frames (``DocRun.copy_into``), so a window costs its
decoded frames and nothing more.
"""

from __future__ import annotations

import bisect

import numpy as np

from .runs import DocRun
from .window_reads import Pending

_EMPTY = np.zeros(0, np.uint8)


class Window:
    """A window's documents in emission order, each followed by its EOS.

    Args:
        order: the emission order (indexes into ``shard``/``record``).
        lens: each document's tokens, in emission order (0 for the first ``skip``).
        shard, record: the window's records, in the order of its ranges.
        pieces: the documents from position ``skip`` on, as views in ``dtype``; None for a restore,
            which reads them as they are needed (``pending``).
        dtype: the token dtype.
        skip: documents handed on before a restore (laid out empty).
        eos_id: the token after each document, or None.
        pending: a restore's frames still to read, or None.
        cut: under token cuts (``cut_source.CutSource.pieces``), in the order of the window's
            records: each one's first token in its document and whether an EOS follows it.
    """

    def __init__(self, order, lens, shard, record, pieces, dtype, skip: int, eos_id: int | None,
                 pending: Pending | None = None, cut: tuple | None = None) -> None:
        out_lens = lens.copy()
        nothing = _EMPTY.view(dtype)
        # pieces None: a restore, every document laid out empty until its frame is read
        docs = [nothing] * (len(order) if pieces is None else skip) + (
            [] if pieces is None else list(pieces)
        )
        self.eos = None
        if eos_id is None:
            self.stride, parts = 1, docs
        else:
            eos = np.array([eos_id], dtype)
            nonempty = lens > 0  # lens[:skip] are 0: documents a restore passes over
            if cut is not None:  # a piece a token cut ends before its document does: no EOS
                nonempty = nonempty & cut[1][order]
            out_lens += nonempty
            self.stride = 2
            parts = [eos] * (2 * len(docs))
            parts[0::2] = docs
            # an empty piece (a record the source skipped as damaged, or one handed on before
            # a restore) gets no EOS
            parts[1 : 2 * skip : 2] = [nothing] * skip
            for i in (np.flatnonzero(~nonempty[skip:]) + skip).tolist():
                parts[2 * i + 1] = nothing
            self.eos = eos
        self.docs = docs  # each a view of its frame
        self.parts = parts  # the same, each followed by its EOS: ``stride`` entries a document
        offsets = np.zeros(len(order) + 1, np.int64)
        np.cumsum(out_lens, out=offsets[1:])
        self.offsets = offsets.tolist()
        self.lengths = out_lens  # of each document with its EOS
        self.has_empty = not out_lens[skip:].all()
        self.shard = shard[order]
        self.record = record[order]
        self.shards = self.shard.tolist()
        self.records = self.record.tolist()
        self.num_docs = len(self.records)
        self.pending = pending
        # each document's first token in its document (token cuts), or None
        self.base = None if cut is None or not cut[0].any() else cut[0][order]

    def length(self, doc: int) -> int:
        """Tokens of document ``doc`` with its EOS."""
        return self.offsets[doc + 1] - self.offsets[doc]

    def ensure(self, stop: int) -> None:
        """Read a restored window's pending frames until every document before position
        ``stop`` is laid out."""
        if self.pending is not None:
            self.pending.read_until(stop, self._place)
            if self.pending.done:
                self.pending = None

    def _place(self, position: int, tokens: np.ndarray) -> None:
        self.docs[position] = tokens
        self.parts[position * self.stride] = tokens

    def cut(self, doc: int, a: int, b: int) -> list:
        """Tokens ``a..b-1`` of document ``doc`` counted with its EOS, as parts."""
        tokens = self.docs[doc]
        n = len(tokens)
        if b <= n:
            return [tokens[a:b]]
        return [tokens[a:], self.eos] if a < n else [self.eos]

    def run(self, pos: int, token_offset: int, n: int, max_docs: int) -> tuple[DocRun, int, int]:
        """Up to ``n`` tokens from at most ``max_docs`` documents from ``pos`` on (the first
        ``token_offset`` tokens in), only the last cut short: ``(run, documents begun, the
        window offset where it stops)``. One slice of the parts, cut at its ends."""
        offsets = self.offsets
        first = offsets[pos] + token_offset
        last_doc = min(pos + max_docs, self.num_docs)  # exclusive
        limit = first + n
        # documents pos..j-1 end at or before the limit
        j = bisect.bisect_right(offsets, limit) - 1
        whole = min(max(j, pos), last_doc)
        if whole < last_doc and offsets[whole] < limit:
            stop, docs, done = limit, whole + 1 - pos, False  # the last document is cut
        else:
            stop, docs, done = offsets[whole], whole - pos, True
        length = self.lengths[pos : pos + docs].copy()
        token_start = np.zeros(docs, np.int64)
        if docs:
            token_start[0] = token_offset
            length[0] -= token_offset
            if self.base is not None:
                token_start += self.base[pos : pos + docs]
            length[-1] -= offsets[pos + docs] - stop
        self.ensure(pos + max(docs, 1))
        # drop damaged (empty) documents
        keep = length > 0 if self.has_empty else slice(None)
        stride = self.stride
        if docs == 0:
            parts = []
        elif docs == 1:
            parts = self.cut(pos, first - offsets[pos], stop - offsets[pos])
        else:
            parts = self.parts[pos * stride : (pos + docs) * stride]
            last = pos + docs - 1
            if not done:  # the last document is cut at the limit
                parts[-stride:] = self.cut(last, 0, stop - offsets[last])
            if token_offset:  # the first one was begun already
                parts[:stride] = self.cut(pos, token_offset, offsets[pos + 1] - offsets[pos])
        run = DocRun(
            parts=parts,
            size=stop - first,
            shard=self.shard[pos : pos + docs][keep],
            record=self.record[pos : pos + docs][keep],
            token_start=token_start[keep],
            length=length[keep],
            done=done,
        )
        return run, docs, stop
