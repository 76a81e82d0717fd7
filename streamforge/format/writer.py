"""Writing shards and manifests.

Shard and frame boundaries are a pure function of the records' archive sizes (``cut_points``),
so a parallel converter can place every record before writing a byte, and any number of
workers produces the same files. A dataset becomes visible only when its manifest is
written, after every shard.

Replacing a stream never touches a file its live manifest lists: the new shards take the next
*generation* of names (``shard-NNNNNN.gG.tar.zst``, ``manifest.shard_name``), ``index.json``
is replaced last (one PUT on an object store, a rename on a local disk), and only then are
the files the new manifest does not list removed. Whenever a conversion is killed, the
prefix opens as the old complete stream or the new one, never a mix.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import ConfigError
from ..storage.open import join, open_url
from .frames import CODECS, FRAME_DTYPE, RECORD_DTYPE, encode_index, frame_encoder
from .manifest import TOKEN_DTYPES, Manifest, shard_name
from .publish import (  # noqa: F401 - re-exported: converters import them from here
    build_manifest, live_manifest, make_output_dir, next_generation, prepare_output, remove_unlisted, write_manifest,
)
from .tar import (
    BLOCK,
    END_OF_ARCHIVE,
    encode_record,
    npy_header,
    npy_member_headers,
    record_nbytes,
    records_nbytes,
)

DEFAULT_SHARD_SIZE = 64 << 20
DEFAULT_FRAME_SIZE = 256 << 10

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(size: int | str) -> int:
    """``"64MiB"`` -> 67108864; plain ints pass through. Accepts k/M/G/T with or without i/B."""
    if isinstance(size, (int, np.integer)):
        value = int(size)
    else:
        match = _SIZE_RE.match(str(size))
        if not match:
            raise ConfigError(f"cannot parse size {size!r} (examples: 65536, '256KiB', '64MiB')")
        unit = (match.group(2) or "").lower()
        base = 1024 ** "bkmgt".index(unit[0]) if unit.endswith("ib") or unit.endswith("i") else None
        mult = base if base is not None else _UNITS[unit[:1]]
        value = int(float(match.group(1)) * mult)
    if value <= 0:
        raise ConfigError(f"size must be positive, got {size!r}")
    return value


def cut_points(nbytes: Sequence[int] | np.ndarray, target: int) -> list[int]:
    """Start indices of the groups when items of ``nbytes`` are packed greedily up to ``target``.

    An item opens a new group when the current group is non-empty and would pass the target,
    so a group holds at least one item and an oversized item stands alone.
    """
    starts: list[int] = []
    current = 0
    for i, size in enumerate(np.asarray(nbytes, dtype=np.int64).tolist()):
        if not starts or (current > 0 and current + size > target):
            starts.append(i)
            current = 0
        current += size
    return starts


def choose_token_dtype(max_token: int, vocab_size: int | None = None) -> str:
    """uint16 when every id (and the vocabulary, if known) fits, else uint32."""
    top = max(max_token, (vocab_size - 1) if vocab_size else 0)
    if top < 2**16:
        return "uint16"
    if top < 2**32:
        return "uint32"
    raise ConfigError(f"token id {top} does not fit in uint32")


def encode_meta(meta: Any) -> bytes | None:
    if meta is None:
        return None
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


@dataclass
class EncodedShard:
    """One shard's file bytes and its manifest row (sha256 computed on first use, or while
    ``write_shard`` writes the bytes, so hashing can run beside the next shard's encoding)."""

    parts: list[bytes]
    counts: dict[str, Any]
    _sha256: str | None = None

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            digest = hashlib.sha256()
            for part in self.parts:
                digest.update(part)
            self._sha256 = digest.hexdigest()
        return self._sha256

    @property
    def row(self) -> dict[str, Any]:
        return {**self.counts, "sha256": self.sha256}


def encode_shard(
    records: Iterable[tuple[int, np.ndarray, bytes | None]],
    *,
    frame_size: int = DEFAULT_FRAME_SIZE,
    compression_level: int = 3,
    compression: str = "zstd",
) -> EncodedShard:
    """Encode ``(record_idx, tokens, meta_json)`` triples into one shard.

    ``tokens`` must already be of the stream's token dtype (little-endian).
    """
    records = list(records)
    nbytes = [record_nbytes(t.size, t.dtype.itemsize, None if m is None else len(m)) for _, t, m in records]
    frame_starts = cut_points(nbytes, frame_size) if records else [0]
    compress = frame_encoder(compression, compression_level)
    frames = np.zeros(len(frame_starts), FRAME_DTYPE)
    table = np.zeros(len(records), RECORD_DTYPE)
    parts: list[bytes] = []
    comp_offset = 0
    num_tokens = 0
    bounds = frame_starts[1:] + [len(records)]
    for f, (lo, hi) in enumerate(zip(frame_starts, bounds)):
        raw: list[bytes] = []
        pos = 0
        for r in range(lo, hi):
            record_idx, tokens, meta = records[r]
            rec_parts, token_offset = encode_record(record_idx, tokens, meta)
            table[r] = (pos + token_offset, tokens.size, 0, 0)
            if meta is not None:
                meta_offset = pos + nbytes[r] - len(meta) - (-len(meta)) % 512
                table[r]["meta_offset"], table[r]["meta_size"] = meta_offset, len(meta)
            raw.extend(rec_parts)
            pos += nbytes[r]
            num_tokens += tokens.size
        if f == len(frame_starts) - 1:
            raw.append(END_OF_ARCHIVE)
        blob = b"".join(raw)
        comp = compress(blob)
        frames[f] = (comp_offset, len(comp), len(blob), lo)
        parts.append(comp)
        comp_offset += len(comp)
    return _finish_shard(parts, frames, table, num_tokens)


@functools.lru_cache(maxsize=1 << 16)
def _npy_header_cached(num_items: int, dtype_str: str) -> bytes:
    return npy_header(num_items, np.dtype(dtype_str))


def encode_shard_flat(
    tokens: np.ndarray,
    offsets: np.ndarray,
    first_record: int,
    *,
    frame_size: int = DEFAULT_FRAME_SIZE,
    compression_level: int = 3,
    compression: str = "zstd",
) -> EncodedShard:
    """``encode_shard`` for records without metadata, given column-wise; the same bytes.

    Record ``i`` is ``tokens[offsets[i]:offsets[i+1]]`` with record index
    ``first_record + i``; ``tokens`` must already be of the stream's token dtype. Headers
    are built with numpy and each record costs three buffer copies, so compression, not
    Python, sets the pace.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    n = len(lengths)
    itemsize = tokens.dtype.itemsize
    nbytes = records_nbytes(lengths, itemsize)
    record_start = np.zeros(n + 1, np.int64)
    np.cumsum(nbytes, out=record_start[1:])
    # The shard's whole tar stream in one zeroed buffer. Records are whole 512-byte blocks,
    # so every tar header is one row of a block view and every .npy header starts the next.
    raw = np.zeros(int(record_start[n]) + len(END_OF_ARCHIVE), np.uint8)
    blocks = raw.reshape(-1, BLOCK)
    head_block = record_start[:n] // BLOCK
    unique_lengths, inverse = np.unique(lengths, return_inverse=True)
    npy_heads = [_npy_header_cached(int(k), tokens.dtype.str) for k in unique_lengths.tolist()]
    head_sizes = np.array([len(h) for h in npy_heads], dtype=np.int64)
    header_sizes = head_sizes[inverse] if n else np.zeros(0, np.int64)
    blocks[head_block] = npy_member_headers(first_record, header_sizes + lengths * itemsize)
    for size in np.unique(head_sizes).tolist():
        kinds = np.flatnonzero(head_sizes == size)
        rows = np.frombuffer(b"".join(npy_heads[k] for k in kinds.tolist()), np.uint8)
        lookup = np.full(len(npy_heads), -1, np.int64)
        lookup[kinds] = np.arange(len(kinds))
        chosen = np.flatnonzero(header_sizes == size)
        blocks[head_block[chosen] + 1, :size] = rows.reshape(-1, size)[lookup[inverse[chosen]]]
    data_start = record_start[:n] + BLOCK + header_sizes
    out = memoryview(raw)
    token_bytes = memoryview(np.ascontiguousarray(tokens).view(np.uint8))
    byte_offsets = (offsets * itemsize).tolist()
    for r, dst in enumerate(data_start.tolist()):
        lo, hi = byte_offsets[r], byte_offsets[r + 1]
        out[dst : dst + hi - lo] = token_bytes[lo:hi]

    frame_starts = cut_points(nbytes, frame_size) if n else [0]
    bounds = frame_starts[1:] + [n]
    compress = frame_encoder(compression, compression_level)
    table = np.zeros(n, RECORD_DTYPE)
    table["num_tokens"] = lengths
    frames = np.zeros(len(frame_starts), FRAME_DTYPE)
    parts: list[bytes] = []
    comp_offset = 0
    for f, (lo, hi) in enumerate(zip(frame_starts, bounds)):
        base = int(record_start[lo])
        stop = int(record_start[hi]) if f + 1 < len(frame_starts) else len(raw)
        table["token_offset"][lo:hi] = data_start[lo:hi] - base
        comp = compress(out[base:stop])
        frames[f] = (comp_offset, len(comp), stop - base, lo)
        parts.append(comp)
        comp_offset += len(comp)
    num_tokens = int(lengths.sum())
    return _finish_shard(parts, frames, table, num_tokens)


def _finish_shard(parts: list[bytes], frames: np.ndarray, table: np.ndarray, num_tokens: int) -> EncodedShard:
    """Append the index frame to the compressed frames and count what the manifest records."""
    index = encode_index(frames, table, num_tokens)
    comp_offset = sum(len(p) for p in parts)
    parts.append(index)
    counts = {
        "bytes": comp_offset + len(index),
        "num_records": len(table),
        "num_tokens": num_tokens,
        "num_docs": int(np.count_nonzero(table["num_tokens"])),
        "num_frames": len(frames),
        "index_offset": comp_offset,
        "index_bytes": len(index),
    }
    return EncodedShard(parts=parts, counts=counts)


def write_shard(
    fs, path: str, shard: int, encoded: EncodedShard, compression: str = "zstd", generation: int = 0
) -> dict[str, Any]:
    """Write one encoded shard as ``<path>/shard-NNNNNN.tar.zst`` (``.tar`` uncompressed;
    ``shard-NNNNNN.gG.tar.zst`` for a later ``generation``); returns its manifest row."""
    name = shard_name(shard, compressed=compression != "none", generation=generation)
    digest = hashlib.sha256()
    with fs.open(join(path, name), "wb") as out:
        for part in encoded.parts:
            digest.update(part)
            out.write(part)
    encoded._sha256 = digest.hexdigest()
    return {"name": name, **encoded.row}


class ShardWriter:
    """Append documents one at a time; shards are written as they fill, the manifest last.

    >>> with ShardWriter("/tmp/stream", token_dtype="uint16", eos_id=0) as w:  # doctest: +SKIP
    ...     w.write(np.array([5, 6, 7]))

    Args:
        url: the stream's prefix (any fsspec URL); shards and ``index.json`` go under it.
        token_dtype: ``"uint16"`` or ``"uint32"``, the dtype every token is stored in.
        shard_size: uncompressed archive bytes per shard (an int or ``"64MiB"``); a record
            larger than that gets a shard of its own.
        frame_size: uncompressed bytes per zstd frame, cut at record boundaries.
        compression_level: the zstd level.
        compression: ``"zstd"`` (``.tar.zst`` shards) or ``"none"`` (plain ``.tar``).
        eos_id: the end-of-document token id, if known.
        vocab_size: the vocabulary size, if known; every token id must be below it.
        docs_end_with_eos: every document already ends with ``eos_id``.
        storage_options: passed to the filesystem of ``url``.
        conversion: what the manifest's ``conversion`` records besides the writer's sizes.
        source_fingerprint: an identifier of the input, so rewriting the same input over its
            own stream is allowed (docs/format.md, "Atomicity and overwriting").
        overwrite: replace a stream already at ``url`` that came from another input.
    """

    def __init__(
        self,
        url: str,
        *,
        token_dtype: str = "uint16",
        shard_size: int | str = "64MiB",
        frame_size: int | str = DEFAULT_FRAME_SIZE,
        compression_level: int = 3,
        compression: str = "zstd",
        eos_id: int | None = None,
        vocab_size: int | None = None,
        docs_end_with_eos: bool = False,
        storage_options: dict[str, Any] | None = None,
        conversion: dict[str, Any] | None = None,
        source_fingerprint: str | None = None,
        overwrite: bool = False,
    ) -> None:
        if token_dtype not in TOKEN_DTYPES:
            raise ConfigError(f"token_dtype must be one of {TOKEN_DTYPES}, got {token_dtype!r}")
        if vocab_size is not None and vocab_size > np.iinfo(token_dtype).max + 1:
            raise ConfigError(f"vocab_size {vocab_size} does not fit token_dtype {token_dtype}")
        self.url = str(url)
        self.token_dtype = token_dtype
        self._dtype = np.dtype(token_dtype).newbyteorder("<")
        self.shard_size = parse_size(shard_size)
        self.frame_size = parse_size(frame_size)
        self.compression_level = int(compression_level)
        if compression not in CODECS:
            raise ConfigError(f"compression must be one of {CODECS}, got {compression!r}")
        self.compression = compression
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self.docs_end_with_eos = docs_end_with_eos
        self.conversion = dict(conversion or {})
        self.source_fingerprint = source_fingerprint
        self._fs, self._path = open_url(self.url, storage_options)
        make_output_dir(self._fs, self._path, self.url)
        self._generation = prepare_output(
            self._fs, self._path, self.url, source_fingerprint=source_fingerprint, overwrite=overwrite
        )
        self._pending: list[tuple[int, np.ndarray, bytes | None]] = []
        self._pending_bytes = 0
        self._rows: list[dict[str, Any]] = []
        self._num_records = 0
        self._manifest: Manifest | None = None

    def write(self, tokens: Any, meta: Any = None) -> int:
        """Append one document; returns its record index in the stream."""
        if self._manifest is not None:
            raise ConfigError(f"{self.url}: write() after close()")
        array = np.asarray(tokens)
        record_idx = self._num_records
        if array.ndim != 1:
            raise ConfigError(f"{self.url}: record {record_idx}: tokens must be 1-D, got {array.shape}")
        if array.size and not np.issubdtype(array.dtype, np.integer):
            raise ConfigError(f"{self.url}: record {record_idx}: tokens must be integers, got {array.dtype}")
        if array.size:
            low, high = int(array.min()), int(array.max())
            limit = self.vocab_size if self.vocab_size is not None else np.iinfo(self._dtype).max + 1
            if low < 0 or high >= limit:
                bad = low if low < 0 else high
                what = f"vocab_size {self.vocab_size}" if self.vocab_size else self.token_dtype
                raise ConfigError(f"{self.url}: record {record_idx}: token id {bad} outside {what}")
        array = array.astype(self._dtype, copy=False)
        meta_json = encode_meta(meta)
        size = record_nbytes(array.size, array.dtype.itemsize, None if meta_json is None else len(meta_json))
        if self._pending and self._pending_bytes + size > self.shard_size:
            self._flush()
        self._pending.append((record_idx, array, meta_json))
        self._pending_bytes += size
        self._num_records += 1
        return record_idx

    def _flush(self) -> None:
        encoded = encode_shard(
            self._pending, frame_size=self.frame_size, compression_level=self.compression_level,
            compression=self.compression,
        )
        self._rows.append(
            write_shard(self._fs, self._path, len(self._rows), encoded, self.compression, self._generation)
        )
        self._pending, self._pending_bytes = [], 0

    def close(self) -> Manifest:
        """Write the last shard, then the manifest; returns the manifest."""
        if self._manifest is not None:
            return self._manifest
        if self._pending:
            self._flush()
        if not self._rows:
            raise ConfigError(f"{self.url}: no documents were written; refusing to create an empty stream")
        conversion = {
            "shard_size": self.shard_size,
            "frame_size": self.frame_size,
            "compression_level": self.compression_level,
            **self.conversion,
        }
        manifest = build_manifest(
            self._rows,
            token_dtype=self.token_dtype,
            eos_id=self.eos_id,
            vocab_size=self.vocab_size,
            docs_end_with_eos=self.docs_end_with_eos,
            conversion=conversion,
            source_fingerprint=self.source_fingerprint,
            compression=self.compression,
        )
        write_manifest(self._fs, self._path, manifest)
        remove_unlisted(self._fs, self._path, manifest)
        self._manifest = manifest
        return manifest

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an exception the manifest is not written: the prefix keeps opening as the stream
        # it held before (if any), never as this half-written one.
        if exc_type is None:
            self.close()
