"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, the MMIDIDX layout).

``.idx`` (little-endian)::

    magic       9s   b"MMIDIDX\\x00\\x00"
    version     u64  1
    dtype code  u8   1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    seq_count   u64
    doc_count   u64  entries of doc_idx: number of documents + 1 (it starts with 0)
    sizes       i32[seq_count]   tokens per sequence
    pointers    i64[seq_count]   byte offset of each sequence in .bin
    doc_idx     i64[doc_count]   document i = sequences doc_idx[i] .. doc_idx[i+1]-1
    (modes      i8[seq_count]    multimodal datasets only; ignored)

``.bin`` is the token data. Everything is checked against the file sizes before a shard is
written, and each problem raises ``SourceError`` naming the file. A ``.bin`` longer than the
``.idx`` accounts for converts (only the indexed tokens) with a warning naming both files:
it may be a ``.bin`` appended to after its index was written, or the index of another file.
"""

from __future__ import annotations

import struct
import warnings
from typing import Any

import numpy as np

from ..errors import SourceError
from .base import ArraySource, MappedTokens, file_size, token_dtype_of

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEAD = struct.Struct("<9sQBQQ")


def split_prefix(path: str) -> str:
    """``data/x.bin``, ``data/x.idx`` and ``data/x`` all name the dataset ``data/x``."""
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def read_index(idx_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sizes, pointers, doc_idx) of a ``.idx`` file, its header and length checked."""
    size = file_size(idx_path, "Megatron index (.idx)")
    with open(idx_path, "rb") as f:
        blob = f.read()
    if size < _HEAD.size:
        raise SourceError(f"{idx_path}: {size} bytes, shorter than the {_HEAD.size}-byte header")
    magic, version, code, seq_count, doc_count = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise SourceError(f"{idx_path}: magic {magic!r}, expected {MAGIC!r} (not an MMIDIDX index)")
    if version != VERSION:
        raise SourceError(f"{idx_path}: index version {version}, expected {VERSION}")
    if code not in DTYPE_CODES:
        raise SourceError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    dtype = np.dtype(DTYPE_CODES[code])
    if dtype.kind == "f":
        raise SourceError(f"{idx_path}: dtype code {code} is {dtype}; token ids must be integers")
    expected = _HEAD.size + 12 * seq_count + 8 * doc_count
    if size not in (expected, expected + seq_count):
        raise SourceError(
            f"{idx_path}: {size} bytes, but {seq_count} sequences and {doc_count} document "
            f"entries need {expected} (or {expected + seq_count} with modes): truncated or corrupt"
        )
    offset = _HEAD.size
    sizes = np.frombuffer(blob, "<i4", seq_count, offset).astype(np.int64)
    pointers = np.frombuffer(blob, "<i8", seq_count, offset + 4 * seq_count).astype(np.int64)
    doc_idx = np.frombuffer(blob, "<i8", doc_count, offset + 12 * seq_count).astype(np.int64)
    return dtype, sizes, pointers, doc_idx


def check_index(
    idx_path: str, bin_path: str, bin_size: int, dtype: np.dtype, sizes, pointers, doc_idx
) -> None:
    """Sequence and document tables must describe the ``.bin`` they point into."""
    itemsize = dtype.itemsize
    if bin_size % itemsize:
        raise SourceError(
            f"{bin_path}: {bin_size} bytes is not a multiple of the {dtype} item size {itemsize} "
            f"named by {idx_path}"
        )
    if len(sizes) and int(sizes.min()) < 0:
        bad = int(np.argmin(sizes))
        raise SourceError(f"{idx_path}: sequence {bad} has negative size {int(sizes[bad])}")
    if len(pointers):
        if (pointers % itemsize).any() or int(pointers.min()) < 0:
            bad = int(np.flatnonzero((pointers % itemsize != 0) | (pointers < 0))[0])
            raise SourceError(
                f"{idx_path}: sequence {bad} pointer {int(pointers[bad])} is negative or not a "
                f"multiple of the item size {itemsize}"
            )
        ends = pointers + sizes * itemsize
        overlap = np.flatnonzero(pointers[1:] < ends[:-1])
        if len(overlap):
            bad = int(overlap[0]) + 1
            raise SourceError(
                f"{idx_path}: sequence pointers are not increasing: sequence {bad} starts at byte "
                f"{int(pointers[bad])}, before the end of sequence {bad - 1} ({int(ends[bad - 1])})"
            )
        if int(ends[-1]) > bin_size:
            raise SourceError(
                f"{bin_path}: {bin_size} bytes, but {idx_path} places sequence {len(sizes) - 1} "
                f"up to byte {int(ends[-1])}: the .bin is truncated"
            )
    indexed = int((pointers + sizes * itemsize).max()) if len(pointers) else 0
    if bin_size > indexed:
        warnings.warn(
            f"{bin_path}: {bin_size} bytes, but {idx_path} indexes only {indexed} "
            f"({bin_size - indexed} bytes after the last sequence are not converted); is the "
            ".idx the index of this .bin?",
            stacklevel=3,
        )
    if len(doc_idx) < 1 or int(doc_idx[0]) != 0 or int(doc_idx[-1]) != len(sizes):
        first = int(doc_idx[0]) if len(doc_idx) else None
        last = int(doc_idx[-1]) if len(doc_idx) else None
        raise SourceError(
            f"{idx_path}: doc_idx must run from 0 to the sequence count {len(sizes)}, found "
            f"{first}..{last} ({len(doc_idx)} entries)"
        )
    steps = np.diff(doc_idx)
    if len(steps) and int(steps.min()) < 0:
        bad = int(np.argmin(steps))
        raise SourceError(
            f"{idx_path}: doc_idx decreases at document {bad} ({int(doc_idx[bad])} -> "
            f"{int(doc_idx[bad + 1])})"
        )


def open_megatron(path: str, *, dtype: Any = None, eos_id: int | None = None) -> ArraySource:
    """The documents of the Megatron dataset at ``path`` (a prefix, or its .bin/.idx)."""
    prefix = split_prefix(str(path))
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    idx_dtype, sizes, pointers, doc_idx = read_index(idx_path)
    if dtype is not None and token_dtype_of(dtype, bin_path) != idx_dtype:
        raise SourceError(
            f"{idx_path}: index says dtype {idx_dtype}, but --dtype {np.dtype(dtype)} was given"
        )
    bin_size = file_size(bin_path, "Megatron data (.bin)")
    check_index(idx_path, bin_path, bin_size, idx_dtype, sizes, pointers, doc_idx)
    itemsize = idx_dtype.itemsize
    source = ArraySource(
        where=prefix,
        tokens=MappedTokens(
            path=bin_path, dtype=idx_dtype.newbyteorder("<"), offset=0, count=bin_size // itemsize
        ),
        seq_starts=pointers // itemsize,
        seq_lengths=sizes,
        doc_seqs=doc_idx,
        eos_id=eos_id,
        docs_end_with_eos=False,
        params={"split": "doc_idx"},
    )
    source.format = "megatron"
    return source
