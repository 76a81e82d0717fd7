"""Window: one shuffle window laid out in emission order, as the buffer hands it out.

No token is copied: each document stays in the frame it was decoded into, and the window is
``offsets`` into their virtual concatenation, an EOS after each. A run is copied once, by its
consumer, straight from the frames, so a window costs its decoded frames and nothing more.

A window read whole (the common case) keeps where each document lies (``Spans``) and no object
per document: the compiled core copies a run from the frames (``fill_window``), and the views
of its documents (``docs``, ``parts``) are made only where a consumer asks for them (the numpy
path, a document taken piece by piece, mixed streams). A window restored part-way, or with
documents laid out empty, holds views from the start.
"""

from __future__ import annotations

import bisect

import numpy as np

from .runs import DocRun
from ..format.reader import Spans
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
                 pending: Pending | None = None, cut: tuple | None = None, spans: Spans | None = None) -> None:
        self.dtype = np.dtype(dtype)
        self.eos_id = eos_id
        self.spans = None
        if spans is not None and skip == 0 and pending is None and cut is None and lens.all():
            self._lay_out_spans(spans, order, lens.copy(), shard, record)
            return
        if spans is not None:  # the views, made now
            pieces = spans.views(self.dtype)
        self._lay_out_views(order, lens, shard, record, pieces, skip, pending, cut)

    def _lay_out_spans(self, spans: Spans, order, out_lens, shard, record) -> None:
        """A window read whole, every document non-empty: ``spans`` (in emission order) and no
        object per document."""
        self.spans = spans
        self.stride = 1 if self.eos_id is None else 2
        self.eos = None if self.eos_id is None else np.array([self.eos_id], self.dtype)
        self.eos_arg = -1 if self.eos_id is None else self.eos_id  # the compiled core's: -1 for none
        self._docs = self._parts = None
        if self.eos_id is not None:
            out_lens += 1
        self._set_order(order, out_lens, shard, record)
        self.has_empty = False
        self.pending = None
        self.base = None

    def _set_order(self, order, out_lens, shard, record) -> None:
        offsets = np.zeros(len(order) + 1, np.int64)
        np.cumsum(out_lens, out=offsets[1:])
        self.offsets = offsets.tolist()
        self.lengths = out_lens  # of each document with its EOS
        self.shard = shard[order]
        self.record = record[order]
        self.shards = self.shard.tolist()
        self.records = self.record.tolist()
        self.num_docs = len(self.records)

    @property
    def docs(self) -> list:
        """Each document as a view of its frame (made on first use from the spans)."""
        if self._docs is None:
            self._views_from_spans()
        return self._docs

    @property
    def parts(self) -> list:
        """The documents each followed by its EOS: ``stride`` entries a document."""
        if self._parts is None:
            self._views_from_spans()
        return self._parts

    def _views_from_spans(self) -> None:
        docs = self.spans.views(self.dtype)
        if self.eos is None:
            parts = docs
        else:
            parts = [self.eos] * (2 * len(docs))
            parts[0::2] = docs
        self._docs, self._parts = docs, parts

    def _lay_out_views(self, order, lens, shard, record, pieces, skip: int, pending, cut) -> None:
        """The documents from position ``skip`` on as views (``pieces``), or read as they are
        needed (``pending``)."""
        dtype, eos_id = self.dtype, self.eos_id
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
        self._docs = docs  # each a view of its frame
        self._parts = parts  # the same, each followed by its EOS: ``stride`` entries a document
        self._set_order(order, out_lens, shard, record)
        self.has_empty = not out_lens[skip:].all()
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
        self._docs[position] = tokens
        self._parts[position * self.stride] = tokens

    def doc_tokens(self, doc: int) -> int:
        """Tokens of document ``doc`` without its EOS."""
        if self.spans is not None:
            return int(self.spans.length[doc])
        return len(self._docs[doc])

    def token(self, doc: int, offset: int) -> int:
        """Token ``offset`` of document ``doc`` (below ``doc_tokens(doc)``)."""
        if self.spans is not None:
            return self.spans.token(doc, offset, self.dtype)
        return int(self._docs[doc][offset])

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
        if self.spans is not None:  # the parts are made only where a consumer asks (DocRun.take_parts)
            parts, span = None, (self, pos, docs, token_offset, first, stop, done)
        else:
            parts, span = self.run_parts(pos, docs, token_offset, first, stop, done), None
        shard, record = self.shard[pos : pos + docs], self.record[pos : pos + docs]
        if self.has_empty:  # drop damaged (empty) documents
            keep = length > 0
            shard, record, token_start, length = shard[keep], record[keep], token_start[keep], length[keep]
        run = DocRun(parts=parts, size=stop - first, shard=shard, record=record, token_start=token_start,
                     length=length, done=done, span=span)
        return run, docs, stop

    def run_parts(self, pos: int, docs: int, token_offset: int, first: int, stop: int, done: bool) -> list:
        """The parts of the run of documents ``pos..pos+docs-1`` at window offsets
        ``first..stop-1`` (``run``): one slice of ``parts``, cut at its ends."""
        offsets, stride = self.offsets, self.stride
        if docs == 0:
            return []
        if docs == 1:
            return self.cut(pos, first - offsets[pos], stop - offsets[pos])
        parts = self.parts[pos * stride : (pos + docs) * stride]
        last = pos + docs - 1
        if not done:  # the last document is cut at the limit
            parts[-stride:] = self.cut(last, 0, stop - offsets[last])
        if token_offset:  # the first one was begun already
            parts[:stride] = self.cut(pos, token_offset, offsets[pos + 1] - offsets[pos])
        return parts

    def fill(self, ext, pos: int, token_offset: int, size: int, grid: np.ndarray, filled: int) -> int | None:
        """Copy the run of ``size`` tokens from token ``token_offset`` of document ``pos`` into
        the [R, T+1] ``grid`` from flat position ``filled`` with the compiled core, straight
        from the frames; the tokens written, or None where the core leaves it to the parts."""
        spans = self.spans
        if spans is None or grid.dtype.itemsize != self.dtype.itemsize:
            return None
        return ext.fill_window(spans.frames, spans.frame, spans.start, spans.length,
                               self.eos_arg, pos, token_offset, size, grid, filled)

    def block(self, ext, pos: int, token_offset: int, stream: int, grid: np.ndarray) -> tuple | None:
        """A whole batch from this window with the compiled core: the [R, T+1] ``grid`` filled
        with the R*T tokens from token ``token_offset`` of document ``pos`` on, each row's
        column T holding the token after it, as ``(pieces, documents begun, stop, done)``, the
        pieces being the RowBatch columns (``run`` and the packer's ``_join_runs`` give the
        same). None where the window is not read whole or the batch and the token after it do
        not lie in it: the packer then takes runs."""
        spans = self.spans
        if spans is None or grid.dtype.itemsize != self.dtype.itemsize:
            return None
        offsets = self.offsets
        rows, width = grid.shape
        limit = offsets[pos] + token_offset + rows * (width - 1)
        if limit >= offsets[-1]:
            return None
        last = bisect.bisect_right(offsets, limit) - 1  # documents before it end at or before the limit
        done = offsets[last] == limit
        docs = last - pos + (not done)
        columns = np.empty((4, docs), np.int64)
        shard, streams, continues = np.empty(docs, np.int32), np.empty(docs, np.int16), np.empty(docs, bool)
        if ext.window_block(spans.frames, spans.frame, spans.start, spans.length,
                            self.eos_arg, pos, token_offset, stream, self.shard,
                            self.record, grid, columns, shard, streams, continues) is None:
            return None
        start, length, record, token_start = columns
        pieces = {"start": start, "length": length, "stream": streams, "shard": shard, "record": record,
                  "token_start": token_start, "continues": continues}
        return pieces, docs, limit, done
