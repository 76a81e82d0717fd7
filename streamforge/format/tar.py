"""Deterministic POSIX (ustar) tar members in WebDataset layout, and .npy payloads.

A record is one document: a member ``<key>.npy`` holding a 1-D numpy array of the stream's
token dtype, optionally followed by ``<key>.json`` with its metadata. Every header field that
could vary between runs (mtime, uid, gid, user and group names) is fixed, so the same
documents always give the same bytes.

The layout of a record's bytes is a pure function of (key, num_tokens, itemsize, meta size),
which is what lets a converter place shard and frame boundaries before writing anything.
"""

from __future__ import annotations

import functools

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


def member_mismatch(raw: np.ndarray, rows: np.ndarray, itemsize: int) -> tuple[int, str, int, int | None]:
    """The first of ``rows`` (a run of a frame's record table) whose tar member in ``raw`` (the
    frame's decoded bytes, uint8) is not the size the row gives it, as ``(position in rows,
    "npy" or "json", size the index gives, size the tar header says or None)``; position -1
    when every member agrees. Vectorized: one gather of every header's octal size field, a
    dozen numpy calls per frame whatever its number of records."""
    n = rows["num_tokens"].astype(np.int64)
    heads = npy_header_sizes_fast(n, itemsize)
    # int64: an offset below its header (a damaged row) would wrap around as uint32
    members = [("npy", rows["token_offset"].astype(np.int64) - (BLOCK + heads), heads + n * itemsize, None)]
    meta = rows["meta_size"]
    if meta.any():
        wanted = meta > 0
        at = np.where(wanted, rows["meta_offset"].astype(np.int64) - BLOCK, 0)
        members.append(("json", at, np.where(wanted, meta, 0), wanted))
    found = (-1, "", 0, None)
    for kind, at, size, wanted in members:
        said = header_sizes(raw, at)
        bad = said != size
        if wanted is not None:
            bad &= wanted
        i = int(np.argmax(bad))
        if bad[i] and (found[0] < 0 or i < found[0]):
            found = (i, kind, int(size[i]), int(said[i]) if said[i] >= 0 else None)
    return found


def header_sizes(raw: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The size each ustar header at offsets ``at`` of ``raw`` gives its member: -1 where no
    header fits there or its size field is not octal digits."""
    if len(at) and at.min() >= 0 and at.max() + BLOCK <= len(raw):
        digits = raw[at[:, None] + _SIZE_FIELD] - 48  # uint8: a byte below "0" wraps past 7
        if digits.max() <= 7:
            return digits.astype(np.int64) @ _OCTAL_PLACES
    return np.array([_octal_value(raw, a) if 0 <= a and a + BLOCK <= len(raw) else -1 for a in at.tolist()],
                    dtype=np.int64)


_SIZE_FIELD = np.arange(124, 135)  # a ustar header's size: 11 octal digits (then a NUL)
_OCTAL_PLACES = 8 ** np.arange(10, -1, -1, dtype=np.int64)


def _octal_value(raw: np.ndarray, at: int) -> int:
    text = raw[at + 124 : at + 135].tobytes()
    return int(text, 8) if len(text) == 11 and all(48 <= c <= 55 for c in text) else -1


@functools.lru_cache(maxsize=None)
def npy_header_size_fixed(itemsize: int) -> int | None:
    """The npy header's bytes of a 1-D array of ``itemsize``-byte tokens where it is the same
    for every length (as it is: 128), else None."""
    by_digits = _header_sizes_by_digits(f"<u{itemsize}")
    return int(by_digits[0]) if by_digits[0] == by_digits[-1] else None


def npy_header_sizes_fast(num_items: np.ndarray, itemsize: int) -> np.ndarray | int:
    """``npy_header_sizes``, as one int where every shape gets the same header (a 1-D array's
    header is 128 bytes for any length below 10**19, whatever its token dtype)."""
    by_digits = _header_sizes_by_digits(f"<u{itemsize}")
    if by_digits[0] == by_digits[-1]:
        return int(by_digits[0])
    return by_digits[np.searchsorted(_DIGIT_LIMITS, num_items.astype(np.uint64), side="right")]


# -- columnar fast path ---------------------------------------------------------------------
# Converters encode tens of thousands of records per shard; building each header in Python
# costs more than compressing it. These vectorized twins produce the very same bytes
# (tests compare them with the per-record functions above).

_DIGIT_LIMITS = 10 ** np.arange(1, 20, dtype=np.uint64)


def npy_header_sizes(num_items: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``npy_header_size`` of every entry of ``num_items`` (int64), vectorized.

    The header length depends only on the number of decimal digits of the shape.
    """
    num_items = np.asarray(num_items, dtype=np.int64)
    digits = np.searchsorted(_DIGIT_LIMITS, num_items.astype(np.uint64), side="right")
    return _header_sizes_by_digits(np.dtype(dtype).str)[digits]


@functools.lru_cache(maxsize=None)
def _header_sizes_by_digits(dtype_str: str) -> np.ndarray:
    """``npy_header_size`` of a shape of 1..20 decimal digits (the reader asks once per frame)."""
    sizes = np.array([npy_header_size(10**d, np.dtype(dtype_str)) for d in range(20)], dtype=np.int64)
    sizes.flags.writeable = False
    return sizes


def records_nbytes(num_tokens: np.ndarray, itemsize: int) -> np.ndarray:
    """``record_nbytes(n, itemsize, None)`` for every ``n`` in ``num_tokens``, vectorized."""
    num_tokens = np.asarray(num_tokens, dtype=np.int64)
    payload = npy_header_sizes(num_tokens, np.dtype(f"<u{itemsize}")) + num_tokens * itemsize
    return BLOCK + payload + (-payload) % BLOCK


def npy_member_headers(first_record: int, payload_sizes: np.ndarray) -> np.ndarray:
    """``tar_header(f"{record_key(first_record + i)}.npy", payload_sizes[i])`` for every i.

    Returns an ``(n, 512)`` uint8 array: the fixed fields come from one template, the key
    digits, the octal size and the checksum are computed column-wise.
    """
    sizes = np.asarray(payload_sizes, dtype=np.int64)
    n = len(sizes)
    if first_record + n > 10**12:
        raise ValueError(f"record index {first_record + n - 1} does not fit a 12-digit key")
    template = np.frombuffer(tar_header(record_key(0) + ".npy", 0), np.uint8)
    out = np.tile(template, (n, 1))
    keys = first_record + np.arange(n, dtype=np.int64)
    out[:, 0:12] = (keys[:, None] // (10 ** np.arange(11, -1, -1, dtype=np.int64))) % 10 + 48
    out[:, 124:135] = ((sizes[:, None] >> (3 * np.arange(10, -1, -1))) & 7) + 48
    out[:, 148:156] = ord(" ")
    checksum = out.sum(axis=1, dtype=np.int64)
    out[:, 148:154] = ((checksum[:, None] >> (3 * np.arange(5, -1, -1))) & 7) + 48
    out[:, 154] = 0
    out[:, 155] = ord(" ")
    return out
