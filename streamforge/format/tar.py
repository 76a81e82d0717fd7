"""Deterministic POSIX (ustar) tar members in WebDataset layout, and .npy payloads.

A record is one document: a member ``<key>.npy`` holding a 1-D numpy array of the stream's
token dtype, optionally followed by ``<key>.json`` with its metadata. Every header field that
could vary between runs (mtime, uid, gid, user and group names) is fixed, so the same
documents always give the same bytes.

The layout of a record's bytes is a pure function of (key, num_tokens, itemsize, meta size),
which is what lets a converter place shard and frame boundaries before writing anything.
"""

from __future__ import annotations

import numpy as np

BLOCK = 512
END_OF_ARCHIVE = bytes(2 * BLOCK)
NPY_ALIGN = 64  # numpy's own alignment for .npy headers: token data starts 64-byte aligned

_NPY_MAGIC = b"\x93NUMPY\x01\x00"


def record_key(record_idx: int) -> str:
    """The stable key of a stream's record ``record_idx`` (its index in the source)."""
    return f"{record_idx:012d}"


def npy_header(num_items: int, dtype: np.dtype) -> bytes:
    """The .npy v1.0 header of a 1-D C-order array, padded so the data is 64-byte aligned."""
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    text = "{'descr': %r, 'fortran_order': False, 'shape': (%d,), }" % (descr, num_items)
    body_len = len(_NPY_MAGIC) + 2 + len(text) + 1
    pad = (-body_len) % NPY_ALIGN
    text = text + " " * pad + "\n"
    return _NPY_MAGIC + len(text).to_bytes(2, "little") + text.encode("latin1")


def _octal(value: int, width: int) -> bytes:
    return (b"%0*o" % (width - 1, value)) + b"\0"


def tar_header(name: str, size: int) -> bytes:
    """A ustar header for a regular file with fixed mode, owner and time."""
    encoded = name.encode("utf-8")
    if len(encoded) > 100:
        raise ValueError(f"tar member name too long: {name!r}")
    header = bytearray(BLOCK)
    header[0 : len(encoded)] = encoded
    header[100:108] = _octal(0o644, 8)
    header[108:116] = _octal(0, 8)
    header[116:124] = _octal(0, 8)
    header[124:136] = _octal(size, 12)
    header[136:148] = _octal(0, 12)
    header[148:156] = b" " * 8
    header[156:157] = b"0"
    header[257:265] = b"ustar\x0000"
    checksum = sum(header)
    header[148:156] = b"%06o\0 " % checksum
    return bytes(header)


def padded(size: int) -> int:
    return size + (-size) % BLOCK


def member_bytes(size: int) -> int:
    """Bytes a member of ``size`` data bytes takes in the archive: header plus padded data."""
    return BLOCK + padded(size)


def npy_header_size(num_items: int, dtype: np.dtype) -> int:
    return len(npy_header(num_items, dtype))


def record_nbytes(num_tokens: int, itemsize: int, meta_nbytes: int | None) -> int:
    """Archive bytes of one record; ``meta_nbytes`` is None when it has no .json member."""
    dtype = np.dtype(f"<u{itemsize}")
    size = member_bytes(npy_header_size(num_tokens, dtype) + num_tokens * itemsize)
    if meta_nbytes is not None:
        size += member_bytes(meta_nbytes)
    return size


def encode_record(
    record_idx: int, tokens: np.ndarray, meta_json: bytes | None
) -> tuple[list[bytes], int]:
    """The archive bytes of one record, as a list of parts, and the offset of its token data.

    The token data offset is relative to the start of the record's first header.
    """
    key = record_key(record_idx)
    header = npy_header(tokens.size, tokens.dtype)
    payload_size = len(header) + tokens.nbytes
    parts = [tar_header(f"{key}.npy", payload_size), header, tokens.tobytes()]
    pad = (-payload_size) % BLOCK
    if pad:
        parts.append(bytes(pad))
    if meta_json is not None:
        parts.append(tar_header(f"{key}.json", len(meta_json)))
        parts.append(meta_json)
        pad = (-len(meta_json)) % BLOCK
        if pad:
            parts.append(bytes(pad))
    return parts, BLOCK + len(header)
