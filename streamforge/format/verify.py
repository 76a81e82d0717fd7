"""Check every shard of a stream against its manifest, down to each frame and record.

For each shard: the file's size and sha256, the index where the manifest says, record and
token counts, every offset and frame size the records' lengths give (``checks.check_index``,
as the reader does), frames that tile the bytes before the index, every frame decoding (with
zstd's content checksum) to its raw size, every record's token bytes lying inside its frame,
and every record's tar members and ``.npy`` header being the size and shape the index gives
(a record longer than its index says would otherwise be read cut short). The manifest itself
is checked as every reader checks it (``Manifest.load``). Problems come back as strings that
start with the shard's name; an empty list means OK. Cost: one full read and decompression of
every shard. Local shards are read only where they are regular files (storage/local.py).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import numpy as np
import zstandard

from ..errors import ShardCorruptError, StreamforgeError
from ..storage.open import join, open_url
from .checks import check_index
from .frames import ShardIndex, decode_frame, decode_index
from .manifest import Manifest
from .tar import member_mismatch, npy_header


def verify_stream(url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Problems found in the stream at ``url`` (an empty list when every shard is sound)."""
    try:
        manifest = Manifest.load(url, storage_options)
    except StreamforgeError as exc:
        return [str(exc)]
    fs, path = open_url(url, storage_options, client="auto")  # local: regular files only
    problems: list[str] = []
    for shard in range(manifest.num_shards):
        name = manifest.shard_names[shard]
        try:
            blob = fs.cat_file(join(path, name))
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        except StreamforgeError as exc:
            problems.append(f"{name}: {exc}")
            continue
        problems.extend(f"{name}: {p}" for p in verify_shard(manifest, shard, blob))
    return problems


def verify_shard(manifest: Manifest, shard: int, blob: bytes) -> list[str]:
    """Problems of shard ``shard`` whose file bytes are ``blob``."""
    info = manifest.shards[shard]
    problems = []
    if len(blob) != info.bytes:
        problems.append(f"size {len(blob)} bytes, manifest says {info.bytes}")
    digest = hashlib.sha256(blob).hexdigest()
    if digest != info.sha256:
        problems.append(f"sha256 {digest[:16]}..., manifest says {info.sha256[:16]}...")
    try:
        index = decode_index(blob[info.index_offset : info.index_offset + info.index_bytes], "index")
    except StreamforgeError as exc:
        return problems + [f"index does not decode: {exc}"]
    before = len(problems)
    if index.num_records != info.num_records:
        problems.append(f"index lists {index.num_records} records, manifest {info.num_records}")
    counted = int(index.records["num_tokens"].astype(np.int64).sum())
    if not index.num_tokens == counted == info.num_tokens:
        problems.append(
            f"tokens: index header {index.num_tokens}, records sum {counted}, manifest {info.num_tokens}"
        )
    if index.num_frames != info.num_frames:
        problems.append(f"index lists {index.num_frames} frames, manifest {info.num_frames}")
    if len(problems) == before:  # the counts agree: check every offset the record lengths give
        try:
            check_index(index, manifest, shard, info.name)
        except ShardCorruptError as exc:
            problems.append(str(exc).removeprefix(f"{info.name}: "))
    return problems + verify_frames(
        index, blob, info.index_offset, manifest.token_np_dtype().itemsize, manifest.compression
    )


def verify_frames(
    index: ShardIndex, blob: bytes, index_offset: int, itemsize: int, codec: str = "zstd"
) -> list[str]:
    """Frames tile ``blob[:index_offset]``, decode to their raw size, and hold their records."""
    problems = []
    frames = index.frames
    expected_offset = 0
    decompressor = zstandard.ZstdDecompressor()
    first_records = frames["first_record"].astype(np.int64).tolist() + [index.num_records]
    if first_records != sorted(first_records) or (len(frames) and first_records[0] != 0):
        problems.append("frame first_record values are not increasing from 0")
        return problems
    for f in range(index.num_frames):
        start, size = int(frames["comp_offset"][f]), int(frames["comp_size"][f])
        raw_size = int(frames["raw_size"][f])
        if start != expected_offset:
            problems.append(f"frame {f} starts at byte {start}, expected {expected_offset}")
        expected_offset = start + size
        try:
            raw = decode_frame(codec, blob[start : start + size], raw_size, decompressor)
        except (zstandard.ZstdError, ValueError) as exc:
            problems.append(f"frame {f} (bytes {start}..{start + size}) does not decode: {exc}")
            continue
        records = index.records[first_records[f] : first_records[f + 1]]
        ends = records["token_offset"].astype(np.int64) + records["num_tokens"].astype(np.int64) * itemsize
        outside = np.flatnonzero(ends > raw_size)
        if len(outside):
            r = first_records[f] + int(outside[0])
            problems.append(
                f"record {r} token bytes end at {int(ends[outside[0]])}, past frame {f}'s "
                f"{raw_size} bytes"
            )
            continue
        problems.extend(f"frame {f} record {first_records[f] + i}: {p}" for i, p in _member_problems(raw, records, itemsize))
    if expected_offset != index_offset:
        problems.append(f"frames end at byte {expected_offset}, the index starts at {index_offset}")
    return problems


def _member_problems(raw: bytes, records: np.ndarray, itemsize: int) -> list[tuple[int, str]]:
    """``(position in records, problem)`` for the first record of a frame whose tar member is
    not the size the index gives, and for every ``.npy`` header that does not hold the shape
    ``(num_tokens,)`` of the stream's dtype."""
    view = np.frombuffer(raw, np.uint8)
    found = []
    bad, kind, expected, said = member_mismatch(view, records, itemsize)
    if bad >= 0:
        what = "no tar header" if said is None else f"a tar header of {said} bytes"
        found.append((bad, f"its .{kind} member has {what}, the index gives it {expected} bytes"))
    for i, (offset, n) in enumerate(zip(records["token_offset"].tolist(), records["num_tokens"].tolist())):
        head = _npy_header(n, itemsize)
        if offset < len(head) or raw[offset - len(head) : offset] != head:
            found.append((i, f"its .npy header is not the one of {n} tokens the index gives"))
            break
    return found


@functools.lru_cache(maxsize=1 << 14)
def _npy_header(num_tokens: int, itemsize: int) -> bytes:
    return npy_header(num_tokens, np.dtype(f"<u{itemsize}"))
