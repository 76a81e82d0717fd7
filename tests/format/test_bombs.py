"""Decompression bombs: a frame never expands past the size the shard index gives it.

Each test plants crafted zstd frames into a real stream written by ``ShardWriter``: a frame
of zeros in 128 KiB RLE blocks (4 bytes each), padded with a raw block to exactly the
compressed size of the frame it replaces, so the shard's index, its size and the manifest
stay as written and every check before the decode passes. The reads run in a child process
that reports its peak RSS (``VmHWM``). Before the decode was bounded, each such frame took
what it expands to (issue 35: three 16 KiB frames of 512 MiB took a reader to 1,761 MiB
against an 8 MiB read-ahead budget), and a header that declares 1 TiB raised a bare
``MemoryError`` that ``on_error="skip"`` did not skip.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import zstandard

from helpers.format import shard_path, write_stream
from streamforge.source import ShardSource

BOMB_BYTES = 256 << 20  # what each planted frame expands to
TIB = 1 << 40
MAX_GROWTH = 150 << 20  # peak RSS a read may add over the child's baseline

_BLOCK = 128 << 10  # zstd's largest block
_FRAME_MAGIC = struct.pack("<I", 0xFD2FB528)
ACTUAL = -1  # ``bomb_frame(declares=ACTUAL)``: the header declares the true content size


def bomb_frame(nbytes: int, expands_to: int, declares: int | None) -> bytes:
    """A valid zstd frame of exactly ``nbytes`` that decodes to ``expands_to`` zero bytes and a
    little more (128 KiB RLE blocks, then one raw block of padding). Its header declares
    ``declares`` bytes of content (``ACTUAL``: the true size), or no size at all (None: a
    128 KiB window instead)."""
    head = 4 + (2 if declares is None else 9)
    rle = struct.pack("<I", (_BLOCK << 3) | (1 << 1))[:3] + b"\0"  # block type 1: one byte, repeated
    blocks = rle * (expands_to // _BLOCK)
    pad = nbytes - head - len(blocks) - 3
    if not 0 <= pad <= _BLOCK:
        raise ValueError(f"a {nbytes}-byte frame cannot expand to {expands_to} bytes")
    if declares is None:
        header = _FRAME_MAGIC + bytes([0x00, 0x38])  # no content size; window 2**(10 + 7)
    else:
        size = (expands_to // _BLOCK) * _BLOCK + pad if declares == ACTUAL else declares
        header = _FRAME_MAGIC + bytes([0xE0]) + struct.pack("<Q", size)  # 8-byte size, single segment
    last = struct.pack("<I", (pad << 3) | 1)[:3]  # block type 0 (raw), last block
    return header + blocks + last + bytes(pad)


BOMBS = {
    "declared": ACTUAL,
    "declares 1 TiB": TIB,
    "no declared size": None,
}


@pytest.fixture
def stream(tmp_path):
    """Incompressible tokens in 32 KiB frames (each compressed larger than a bomb needs), two
    shards. Returns ``(url, docs, manifest)``."""
    rng = np.random.default_rng(35)
    docs = [rng.integers(0, 2**16, size=4000) for _ in range(64)]
    url = str(tmp_path / "stream")
    manifest = write_stream(url, docs, shard_size="256KiB", frame_size="32KiB")
    assert manifest.num_shards >= 2 and manifest.shards[0].num_frames >= 5
    return url, docs, manifest


def plant(url, manifest, shard: int, frames: dict[int, str]) -> dict[int, dict]:
    """Replace frames of ``shard`` by the bombs named in ``frames`` ({frame: kind}), byte for
    byte in place. Returns, for each, its records ``(first, stop)``, the ``raw_size`` the
    index gives it and the size its header declares (-1: none)."""
    index = ShardSource.open(url).index(shard)
    planted = {}
    with open(shard_path(url, manifest, shard), "r+b") as f:
        for frame, kind in frames.items():
            offset, size, raw_size = (int(index.frames[k][frame]) for k in ("comp_offset", "comp_size", "raw_size"))
            bomb = bomb_frame(size, BOMB_BYTES, BOMBS[kind])
            f.seek(offset)
            f.write(bomb)
            planted[frame] = {
                "records": (int(index.frames["first_record"][frame]), index.record_stop(frame)),
                "raw_size": raw_size, "declares": zstandard.frame_content_size(bomb),
            }
    return planted


def test_the_planted_frames_are_valid_zstd():
    """The crafted frames decode (small ones here) to what they declare: the tests below fail
    on their size, not on a malformed frame."""
    for declares in (ACTUAL, None):
        frame = bomb_frame(100_000, 1 << 20, declares)
        assert len(frame) == 100_000
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(frame)
        assert len(raw) > 1 << 20 and raw == bytes(len(raw))
        assert zstandard.frame_content_size(frame) == (len(raw) if declares == ACTUAL else -1)
    assert zstandard.frame_content_size(bomb_frame(32 << 10, BOMB_BYTES, ACTUAL)) > BOMB_BYTES


_CHILD = r"""
import json, sys
from streamforge.source import ShardSource, read_records
from streamforge.storage.config import StorageConfig

def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))

url, shard, frame_records, cache_dir = json.loads(sys.argv[1])
first = frame_records[0]

def whole(config):
    source = ShardSource.open(url, config=config)
    n = source.index(shard).num_records
    source.plan_reads([(shard, 0, n)])
    batch = source.read(shard, 0, n)
    return source, batch

def run(path):
    if path == "read_records":  # whole shard, a frame at a time, no read-ahead
        list(read_records(url, shard))
    elif path == "read_records few":  # frame table, record rows, one frame
        list(read_records(url, shard, first, first + 1))
    elif path == "read-ahead":  # decoded on the prefetch threads first
        whole(StorageConfig(prefetch_bytes=8 << 20))
    elif path == "cache":  # the second read takes the frame from the cache
        for _ in range(2):
            try:
                whole(StorageConfig(prefetch_bytes=0, cache_dir=cache_dir))
            except Exception as exc:
                error = exc
        raise error
    elif path == "loader skip":  # the whole pipeline: shuffle window, packing, skipped()
        from streamforge import PackedTokenDataset, Stream, StreamingLoader
        storage = StorageConfig(on_error="skip", prefetch_bytes=8 << 20)
        dataset = PackedTokenDataset([Stream(url, name="bombed")], seq_len=256, shuffle_buffer=64,
                                     eos_id=0, storage=storage)
        loader = StreamingLoader(dataset, batch_size=4)
        steps = sum(1 for _ in loader)
        return {"steps": steps, "skipped": loader.skipped()}
    elif path.startswith("skip"):
        budget = 8 << 20 if path == "skip read-ahead" else 0
        source, batch = whole(StorageConfig(prefetch_bytes=budget, on_error="skip"))
        return {"records": batch.record.tolist(), "skipped": source.skipped}

list(read_records(url, 1 - shard))  # warm up: imports, decoders, allocator arenas
base = peak()
report = {"base": base}
for path in sys.argv[2:]:
    try:
        report[path] = {"result": run(path)}
    except BaseException as exc:
        report[path] = {"error": type(exc).__name__, "message": str(exc)}
    report[path]["growth"] = peak() - base
print(json.dumps(report))
"""


def read_in_child(url, shard, records, cache_dir, paths):
    """Run ``paths`` (see ``_CHILD``) on ``shard`` in a fresh interpreter; its report."""
    args = json.dumps([url, shard, records, str(cache_dir)])
    done = subprocess.run([sys.executable, "-c", _CHILD, args, *paths], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


RAISING_PATHS = ("read_records", "read_records few", "read-ahead", "cache")


@pytest.mark.parametrize("kind", list(BOMBS))
def test_a_bomb_frame_is_refused_within_bounded_memory(stream, tmp_path, kind):
    """On every path that decodes (whole shard, a few records, read-ahead threads, the frame
    cache): a ``ShardCorruptError`` naming the stream, shard and frame, and the sizes where the
    header declares one, with no more memory than a few frames."""
    url, _, manifest = stream
    bomb = plant(url, manifest, 0, {1: kind})[1]
    report = read_in_child(url, 0, bomb["records"], tmp_path / "cache", RAISING_PATHS)
    for path in RAISING_PATHS:
        got = report[path]
        assert got["growth"] < MAX_GROWTH, (path, got["growth"] >> 20, "MiB", got)
        assert got.get("error") == "ShardCorruptError", (path, got)
        message = got["message"]
        assert f"{url}/{manifest.shard_names[0]} frame 1" in message, (path, message)
        if bomb["declares"] >= 0:  # refused from its header, before decoding
            expected = f"header declares {bomb['declares']} bytes, index says {bomb['raw_size']}"
            assert expected in message, (path, message)


@pytest.mark.parametrize("path", ["skip read-ahead", "skip"])
def test_on_error_skip_leaves_out_the_records_of_bomb_frames(stream, tmp_path, path):
    """Three bombs in one shard, read under an 8 MiB read-ahead budget (or none): their
    records are skipped and listed, every other record is read, and memory stays flat."""
    url, _, manifest = stream
    bombs = {1: "declared", 2: "declares 1 TiB", 3: "no declared size"}
    planted = plant(url, manifest, 0, bombs)
    records = {frame: planted[frame]["records"] for frame in bombs}
    report = read_in_child(url, 0, records[1], tmp_path / "cache", [path])[path]
    assert "result" in report, report
    lost = {r for frame in bombs for r in range(*records[frame])}
    num_records = manifest.shards[0].num_records
    assert report["result"]["records"] == [r for r in range(num_records) if r not in lost]
    skipped = report["result"]["skipped"]
    assert [(e["shard"], e["frame"], e["start"], e["stop"]) for e in skipped] == [
        (manifest.shard_names[0], frame, *records[frame]) for frame in bombs
    ]
    assert all("frame does not decode" in e["reason"] for e in skipped)
    assert report["growth"] < MAX_GROWTH, (report["growth"] >> 20, "MiB")


def test_the_loader_reports_the_skipped_bomb_frames(stream, tmp_path):
    """``StreamingLoader.skipped()`` names each bomb frame of a stream read with
    ``on_error="skip"``, and the pass goes on within bounded memory."""
    url, _, manifest = stream
    bombs = {2: "declares 1 TiB", 4: "declared"}
    planted = plant(url, manifest, 1, bombs)
    report = read_in_child(url, 1, planted[2]["records"], tmp_path / "cache", ["loader skip"])["loader skip"]
    assert "result" in report, report
    skipped = sorted(report["result"]["skipped"], key=lambda e: e["frame"])
    assert [(e["stream"], e["shard"], e["frame"], e["start"], e["stop"]) for e in skipped] == [
        ("bombed", manifest.shard_names[1], frame, *planted[frame]["records"]) for frame in bombs
    ]
    assert report["result"]["steps"] > 0
    assert report["growth"] < MAX_GROWTH, (report["growth"] >> 20, "MiB")
