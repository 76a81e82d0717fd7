"""The zstd frame layout of a shard and its seek index.

A shard is a sequence of independent zstd frames, each starting at a record boundary of the
tar stream and carrying zstd's content checksum and content size, followed by one zstd
*skippable* frame that holds the shard index. ``zstd -dc`` ignores skippable frames, so the
concatenated frames decompress to a plain tar archive.

Index payload (all little-endian)::

    magic   8s   b"SFINDEX1"
    num_frames   u32
    num_records  u32
    num_tokens   u64
    frames  num_frames  x (comp_offset u64, comp_size u32, raw_size u32, first_record u32)
    records num_records x (token_offset u32, num_tokens u32, meta_offset u32, meta_size u32)

``token_offset`` and ``meta_offset`` are byte offsets inside the frame's decompressed bytes;
``meta_size`` 0 means the record has no metadata member. The manifest stores each shard's
``index_offset``/``index_bytes`` so a reader fetches the index with one ranged request, and
any record with one more: at most one frame's bytes precede it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import zstandard

from ..errors import ShardCorruptError

SKIPPABLE_MAGIC = 0x184D2A5B  # one of zstd's 16 skippable-frame magics (0x184D2A50-5F)
ZSTD_MAGIC = 0xFD2FB528
INDEX_MAGIC = b"SFINDEX1"
_INDEX_HEAD = struct.Struct("<8sIIQ")

FRAME_DTYPE = np.dtype(
    [("comp_offset", "<u8"), ("comp_size", "<u4"), ("raw_size", "<u4"), ("first_record", "<u4")]
)
RECORD_DTYPE = np.dtype(
    [("token_offset", "<u4"), ("num_tokens", "<u4"), ("meta_offset", "<u4"), ("meta_size", "<u4")]
)


CODECS = ("zstd", "none")


def frame_encoder(codec: str, level: int = 3):
    """``bytes -> bytes`` for one frame: a zstd frame with content checksum and size, or the
    raw bytes themselves (``none``: a plain ``.tar`` shard, checked by size and sha256 only)."""
    if codec == "none":
        return bytes
    if codec != "zstd":
        raise ValueError(f"compression must be one of {CODECS}, got {codec!r}")
    return zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True).compress


def decode_frame(codec: str, buf, raw_size: int, decompressor) -> bytes:
    """One frame's raw bytes, never more than ``raw_size`` (its size in the shard index);
    raises ``zstandard.ZstdError`` or ``ValueError`` when damaged (callers name the frame).

    The decode is bounded before it starts. zstd allocates the content size a frame header
    declares, so a 16 KiB frame of zeros can take 512 MiB, or ask for 1 TiB: a header that
    declares another size than the index is refused without decoding (reading the header
    costs a tiny fraction of decoding the frame). A frame
    that declares no size (ours always do) is decoded into at most ``raw_size`` bytes and
    refused where it needs more.
    """
    if codec == "none":
        raw = bytes(buf)
    else:
        declared = zstandard.frame_content_size(buf)  # -1: not declared
        if declared == -1:
            try:
                # max_output_size=0 would mean no bound at all
                raw = decompressor.decompress(buf, max_output_size=max(raw_size, 1))
            except zstandard.ZstdError as exc:
                raise ValueError(
                    f"frame header declares no size and the frame does not decode within the "
                    f"{raw_size} bytes the index gives it ({exc})"
                ) from exc
        elif declared != raw_size:
            raise ValueError(f"frame header declares {declared} bytes, index says {raw_size}")
        else:
            raw = decompressor.decompress(buf)
    if len(raw) != raw_size:
        raise ValueError(f"decodes to {len(raw)} bytes, index says {raw_size}")
    return raw


@dataclass(frozen=True)
class ShardIndex:
    """The decoded seek index of one shard."""

    frames: np.ndarray  # FRAME_DTYPE
    records: np.ndarray  # RECORD_DTYPE
    num_tokens: int

    @property
    def num_frames(self) -> int:
        return len(self.frames)

    @property
    def num_records(self) -> int:
        return len(self.records)

    @cached_property
    def first_records(self) -> np.ndarray:
        """Each frame's first record, contiguous: a search in a structured array's field
        would copy the field first, on every call."""
        return np.ascontiguousarray(self.frames["first_record"], dtype=np.int64)

    def frame_of_record(self, record: int | np.ndarray) -> np.ndarray | int:
        """The frame holding ``record`` (vectorized)."""
        found = np.searchsorted(self.first_records, record, side="right") - 1
        return int(found) if np.ndim(found) == 0 else found

    def record_stop(self, frame: int) -> int:
        """One past the last record of ``frame``."""
        if frame + 1 < len(self.frames):
            return int(self.frames["first_record"][frame + 1])
        return len(self.records)

    def byte_range(self, first_frame: int, stop_frame: int) -> tuple[int, int]:
        """The [start, stop) byte range of frames ``first_frame..stop_frame-1`` in the shard."""
        start = int(self.frames["comp_offset"][first_frame])
        last = stop_frame - 1
        return start, int(self.frames["comp_offset"][last] + self.frames["comp_size"][last])


def encode_index(frames: np.ndarray, records: np.ndarray, num_tokens: int) -> bytes:
    """The skippable frame (header included) that stores a shard's index."""
    payload = b"".join(
        [
            _INDEX_HEAD.pack(INDEX_MAGIC, len(frames), len(records), num_tokens),
            frames.astype(FRAME_DTYPE, copy=False).tobytes(),
            records.astype(RECORD_DTYPE, copy=False).tobytes(),
        ]
    )
    return struct.pack("<II", SKIPPABLE_MAGIC, len(payload)) + payload


def frame_table_bytes(num_frames: int) -> int:
    """Bytes from the start of the index frame to the end of its frame table; the record
    table follows, ``RECORD_DTYPE.itemsize`` bytes per record."""
    return 8 + _INDEX_HEAD.size + num_frames * FRAME_DTYPE.itemsize


def decode_frame_table(blob: bytes, where: str) -> np.ndarray:
    """The frame table from the first ``frame_table_bytes(F)`` bytes of an index frame, for
    reading a few records without fetching the whole record table."""
    if len(blob) < 8 + _INDEX_HEAD.size:
        raise ShardCorruptError(f"{where}: index frame truncated ({len(blob)} bytes)")
    magic, _ = struct.unpack_from("<II", blob)
    head, num_frames, _, _ = _INDEX_HEAD.unpack_from(blob, 8)
    if magic != SKIPPABLE_MAGIC or head != INDEX_MAGIC or len(blob) < frame_table_bytes(num_frames):
        raise ShardCorruptError(f"{where}: no index frame table where the manifest says")
    return np.frombuffer(blob, FRAME_DTYPE, num_frames, 8 + _INDEX_HEAD.size)


def decode_index(blob: bytes, where: str) -> ShardIndex:
    """Parse the skippable index frame ``blob``; ``where`` names the shard in errors."""
    if len(blob) < 8 + _INDEX_HEAD.size:
        raise ShardCorruptError(f"{where}: index frame truncated ({len(blob)} bytes)")
    magic, size = struct.unpack_from("<II", blob)
    if magic != SKIPPABLE_MAGIC or size != len(blob) - 8:
        raise ShardCorruptError(
            f"{where}: no index frame where the manifest says (magic {magic:#x}, size {size}, "
            f"{len(blob) - 8} bytes present)"
        )
    head, num_frames, num_records, num_tokens = _INDEX_HEAD.unpack_from(blob, 8)
    if head != INDEX_MAGIC:
        raise ShardCorruptError(f"{where}: bad index magic {head!r}")
    offset = 8 + _INDEX_HEAD.size
    expected = offset + num_frames * FRAME_DTYPE.itemsize + num_records * RECORD_DTYPE.itemsize
    if expected != len(blob):
        raise ShardCorruptError(f"{where}: index is {len(blob)} bytes, its header implies {expected}")
    frames = np.frombuffer(blob, FRAME_DTYPE, num_frames, offset)
    records = np.frombuffer(blob, RECORD_DTYPE, num_records, offset + frames.nbytes)
    return ShardIndex(frames=frames, records=records, num_tokens=num_tokens)
