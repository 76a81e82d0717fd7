"""A conversion source: documents laid out as sequences in one flat token array.

Every source format reduces to the same shape: a 1-D token array (memory-mapped from the
source file, or built in memory for row formats), *sequences* given by ``(start, length)`` in
that array, and *documents* given as ranges of sequences. For all formats but Megatron a
document is exactly one sequence. With that shape the converter learns, before writing a
byte, every document's length (``lengths``), the smallest and largest token id
(``token_range``, one vectorized pass) and a content fingerprint; workers then read
contiguous document ranges with one slice each (``read``).

Whether documents already end with the EOS id is read off the document ends alone
(``ends_with``: one gathered token per document, positions from the sequence table); see
``eos.py`` for the decision. Documents marked in ``append_eos`` get an EOS appended as they
are read, and ``lengths`` counts it, so shard boundaries are placed with it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, SourceError

SCAN_CHUNK = 1 << 24  # tokens per min/max or EOS-search pass: bounded memory on huge files
FINGERPRINT_BLOCKS = 32  # data blocks sampled into the fingerprint
FINGERPRINT_BLOCK_BYTES = 1 << 16
NPY_MAGIC = b"\x93NUMPY"


@dataclass
class MappedTokens:
    """A read-only memory map of a token file that pickles as its path (maps again on use)."""

    path: str
    dtype: np.dtype
    offset: int
    count: int

    def __post_init__(self) -> None:
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            if self.count == 0:
                self._array = np.zeros(0, self.dtype)
            else:
                self._array = np.memmap(
                    self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.count,)
                )
        return self._array

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_array"] = None
        return state


def token_dtype_of(dtype: Any, where: str) -> np.dtype:
    """``dtype`` as a numpy integer dtype, or a SourceError naming ``where``."""
    try:
        result = np.dtype(dtype)
    except TypeError as exc:
        raise ConfigError(f"{where}: unknown dtype {dtype!r}") from exc
    if result.kind not in "iu":
        raise SourceError(f"{where}: token dtype must be an integer type, found {result}")
    return result


def eos_bounds(tokens: np.ndarray, eos_id: int, where: str) -> np.ndarray:
    """Document boundaries of a token array split after each ``eos_id`` (int64, 0 ... n).

    Each document keeps its EOS; tokens after the last EOS form a final document.
    """
    info = np.iinfo(tokens.dtype)
    if not info.min <= eos_id <= info.max:
        raise ConfigError(f"{where}: eos id {eos_id} is outside the source dtype {tokens.dtype}")
    ends = [
        np.flatnonzero(tokens[lo : lo + SCAN_CHUNK] == eos_id).astype(np.int64) + lo + 1
        for lo in range(0, len(tokens), SCAN_CHUNK)
    ]
    bounds = np.concatenate([np.zeros(1, np.int64), *ends])
    if bounds[-1] != len(tokens):
        bounds = np.append(bounds, np.int64(len(tokens)))
    return bounds


class ArraySource:
    """Documents over one token array; the base of every format's source."""

    format = "array"

    def __init__(
        self,
        *,
        where: str,
        tokens: np.ndarray | MappedTokens,
        seq_starts: np.ndarray,
        seq_lengths: np.ndarray,
        doc_seqs: np.ndarray | None = None,
        eos_id: int | None = None,
        docs_end_with_eos: bool = False,
        params: dict[str, Any] | None = None,
        doc_base: int = 0,
        append_eos: np.ndarray | None = None,
    ) -> None:
        self.where = where
        self._tokens = tokens
        self.seq_starts = np.asarray(seq_starts, dtype=np.int64)
        self.seq_lengths = np.asarray(seq_lengths, dtype=np.int64)
        if doc_seqs is None:
            doc_seqs = np.arange(len(self.seq_starts) + 1, dtype=np.int64)
        self.doc_seqs = np.asarray(doc_seqs, dtype=np.int64)
        self.eos_id = eos_id
        self.docs_end_with_eos = docs_end_with_eos
        self.params = dict(params or {})
        self.doc_base = doc_base
        # Documents (of this view) that get ``eos_id`` appended when read; None: none do.
        self.append_eos = None if append_eos is None else np.asarray(append_eos, dtype=bool)
        gaps = self.seq_starts[1:] != self.seq_starts[:-1] + self.seq_lengths[:-1]
        self.contiguous = not bool(gaps.any())

    @property
    def tokens(self) -> np.ndarray:
        if isinstance(self._tokens, MappedTokens):
            return self._tokens.array
        return self._tokens

    @property
    def dtype(self) -> np.dtype:
        return self._tokens.dtype

    @property
    def num_docs(self) -> int:
        return len(self.doc_seqs) - 1

    def source_lengths(self) -> np.ndarray:
        """Tokens per document in the source (int64), from the sequence table alone."""
        cumulative = np.zeros(len(self.seq_lengths) + 1, np.int64)
        np.cumsum(self.seq_lengths, out=cumulative[1:])
        return cumulative[self.doc_seqs[1:]] - cumulative[self.doc_seqs[:-1]]

    def lengths(self) -> np.ndarray:
        """Tokens per record as written (int64): the source lengths plus appended EOS."""
        lengths = self.source_lengths()
        if self.append_eos is not None:
            lengths = lengths + self.append_eos[: len(lengths)]
        return lengths

    def ends_with(self, token: int, num_docs: int) -> tuple[np.ndarray, np.ndarray]:
        """(non-empty, ends with ``token``): two bool arrays over the first ``num_docs`` documents.

        The position of each document's last token follows from the sequence table, so this
        gathers one token per non-empty document (in increasing file order) and never scans
        the documents themselves; the work is done in bounded chunks of documents.
        """
        cumulative = np.zeros(len(self.seq_lengths) + 1, np.int64)
        np.cumsum(self.seq_lengths, out=cumulative[1:])
        doc_ends = cumulative[self.doc_seqs[1 : num_docs + 1]]
        nonempty = doc_ends > cumulative[self.doc_seqs[:num_docs]]
        ends = np.zeros(num_docs, bool)
        tokens = self.tokens
        for lo in range(0, num_docs, SCAN_CHUNK):
            chunk = np.flatnonzero(nonempty[lo : lo + SCAN_CHUNK]) + lo
            if not len(chunk):
                continue
            last = doc_ends[chunk] - 1  # index of the last token among all sequences' tokens
            seq = np.searchsorted(cumulative, last, side="right") - 1
            where = self.seq_starts[seq] + (last - cumulative[seq])
            ends[chunk] = np.asarray(tokens[where]).astype(np.int64) == int(token)
        return nonempty, ends

    def _spans(self, first_seq: int, stop_seq: int) -> list[tuple[int, int]]:
        """Token ranges holding sequences ``first_seq..stop_seq-1``, merged when contiguous."""
        if stop_seq <= first_seq:
            return []
        if self.contiguous:
            start = int(self.seq_starts[first_seq])
            return [(start, start + int(self.seq_lengths[first_seq:stop_seq].sum()))]
        starts = self.seq_starts[first_seq:stop_seq].tolist()
        lengths = self.seq_lengths[first_seq:stop_seq].tolist()
        return [(s, s + n) for s, n in zip(starts, lengths)]

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Documents ``lo..hi-1`` (stream indices) as flat tokens and int64 offsets from 0."""
        lo_local, hi_local = lo - self.doc_base, hi - self.doc_base
        if lo_local < 0 or hi_local > self.num_docs or hi_local < lo_local:
            raise IndexError(f"{self.where}: documents {lo}..{hi} outside this source view")
        first, stop = int(self.doc_seqs[lo_local]), int(self.doc_seqs[hi_local])
        tokens = self.tokens
        spans = self._spans(first, stop)
        if len(spans) == 1:
            flat = tokens[spans[0][0] : spans[0][1]]
        else:
            flat = np.concatenate([tokens[a:b] for a, b in spans] or [tokens[:0]])
        lengths = self.source_lengths()[lo_local:hi_local]
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if self.append_eos is not None and self.append_eos[lo_local:hi_local].any():
            flat, offsets = self._with_eos(flat, offsets, self.append_eos[lo_local:hi_local])
        return flat, offsets

    def _with_eos(
        self, flat: np.ndarray, offsets: np.ndarray, mask: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``flat`` with ``eos_id`` inserted after each document marked in ``mask``."""
        eos = int(self.eos_id)
        dtype = np.result_type(flat.dtype, np.min_scalar_type(eos))
        # Marked documents are non-empty, so their end offsets are distinct.
        flat = np.insert(np.asarray(flat).astype(dtype, copy=False), offsets[1:][mask], eos)
        added = np.zeros(len(offsets), np.int64)
        np.cumsum(mask, out=added[1:])
        return flat, offsets + added

    def token_range(self, num_docs: int) -> tuple[int, int]:
        """(smallest, largest) token id of the first ``num_docs`` documents; one pass."""
        tokens = self.tokens
        low, high = None, None
        for a, b in self._spans(0, int(self.doc_seqs[num_docs])):
            for lo in range(a, b, SCAN_CHUNK):
                chunk = tokens[lo : min(b, lo + SCAN_CHUNK)]
                if chunk.size:
                    c_low, c_high = int(chunk.min()), int(chunk.max())
                    low = c_low if low is None else min(low, c_low)
                    high = c_high if high is None else max(high, c_high)
        if low is None:
            raise SourceError(f"{self.where}: the corpus holds no tokens")
        return low, high

    def fingerprint(self) -> str:
        """sha256 over the sequence table, the split parameters and sampled data blocks.

        It depends only on content (never on the path), so a copy of a corpus converts to a
        stream with the same ``source_fingerprint``.
        """
        h = hashlib.sha256()
        head = {"format": self.format, "dtype": self.dtype.str, "params": self.params}
        h.update(json.dumps(head, sort_keys=True).encode())
        for table in (self.seq_starts, self.seq_lengths, self.doc_seqs):
            h.update(np.ascontiguousarray(table, dtype="<i8").tobytes())
        raw = self.tokens.view(np.uint8) if self.tokens.size else np.zeros(0, np.uint8)
        h.update(str(raw.size).encode())
        if raw.size <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK_BYTES:
            h.update(raw.tobytes())
        else:
            last = raw.size - FINGERPRINT_BLOCK_BYTES
            for start in np.linspace(0, last, FINGERPRINT_BLOCKS).astype(np.int64).tolist():
                h.update(raw[start : start + FINGERPRINT_BLOCK_BYTES].tobytes())
        return h.hexdigest()[:32]

    def view(self, lo: int, hi: int) -> ArraySource:
        """A self-contained source of documents ``lo..hi-1``, cheap to send to a worker.

        A memory-mapped source pickles as its path; an in-memory one carries only the
        tokens of those documents.
        """
        first, stop = int(self.doc_seqs[lo - self.doc_base]), int(self.doc_seqs[hi - self.doc_base])
        seq_starts = self.seq_starts[first:stop]
        tokens: np.ndarray | MappedTokens = self._tokens
        if not isinstance(tokens, MappedTokens) and stop > first:
            base = int(seq_starts.min())
            end = int((seq_starts + self.seq_lengths[first:stop]).max())
            tokens, seq_starts = tokens[base:end].copy(), seq_starts - base
        return ArraySource(
            where=self.where,
            tokens=tokens,
            seq_starts=seq_starts,
            seq_lengths=self.seq_lengths[first:stop],
            doc_seqs=self.doc_seqs[lo - self.doc_base : hi - self.doc_base + 1] - first,
            eos_id=self.eos_id,
            docs_end_with_eos=self.docs_end_with_eos,
            params=self.params,
            doc_base=lo,
            append_eos=(
                None
                if self.append_eos is None
                else self.append_eos[lo - self.doc_base : hi - self.doc_base]
            ),
        )


def split_source(
    *,
    where: str,
    tokens: np.ndarray | MappedTokens,
    bounds: np.ndarray,
    eos_id: int | None,
    docs_end_with_eos: bool,
    params: dict[str, Any],
    format_name: str,
) -> ArraySource:
    """An ``ArraySource`` whose document i is ``tokens[bounds[i]:bounds[i+1]]``."""
    bounds = np.asarray(bounds, dtype=np.int64)
    source = ArraySource(
        where=where,
        tokens=tokens,
        seq_starts=bounds[:-1],
        seq_lengths=np.diff(bounds),
        eos_id=eos_id,
        docs_end_with_eos=docs_end_with_eos,
        params=params,
    )
    source.format = format_name
    return source


def file_size(path: str, what: str) -> int:
    """Size of a local source file, or a SourceError saying it is missing."""
    import os

    try:
        return os.stat(path).st_size
    except FileNotFoundError as exc:
        raise SourceError(f"{path}: {what} not found") from exc
    except IsADirectoryError as exc:  # pragma: no cover - stat does not raise this
        raise SourceError(f"{path}: {what} is a directory") from exc


def raw_tokens(path: str, dtype: Any, what: str) -> MappedTokens:
    """Map a headerless token file of ``dtype``; its size must be a multiple of the item size."""
    dtype = token_dtype_of(dtype, path)
    size = file_size(path, what)
    if size % dtype.itemsize:
        raise SourceError(
            f"{path}: {size} bytes is not a multiple of the {dtype} item size {dtype.itemsize} "
            "(wrong --dtype, or a truncated file)"
        )
    return MappedTokens(path=path, dtype=dtype, offset=0, count=size // dtype.itemsize)
