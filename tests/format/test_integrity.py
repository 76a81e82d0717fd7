"""Damaged shards fail loudly at the reader, naming the shard and what is wrong."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from helpers.format import shard_path, write_stream
from streamforge.errors import ShardCorruptError
from streamforge.format.frames import RECORD_DTYPE, frame_table_bytes
from streamforge.source import ShardSource, read_records


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("where", [0.5, 0.9])
def test_flipped_byte_inside_a_frame_is_reported(small_stream, where):
    url, _, _, manifest = small_stream
    source = ShardSource.open(url)
    index = source.index(1)
    comp_offset, comp_size = (int(v) for v in (index.frames["comp_offset"][1], index.frames["comp_size"][1]))
    path = shard_path(url, manifest, 1)
    _flip(path, comp_offset + int(comp_size * where))
    first, stop = int(index.frames["first_record"][1]), index.record_stop(1)
    with pytest.raises(ShardCorruptError, match=manifest.shard_names[1]) as info:
        ShardSource.open(url).read(1, first, stop)
    assert "frame 1" in str(info.value)
    # Frames before the damaged one still read: damage stays local.
    assert len(ShardSource.open(url).read(1, 0, first)) == first


def test_checksum_catches_a_flip_that_still_decodes(tmp_path):
    """Incompressible tokens are stored as raw zstd blocks: a flipped byte there decodes to
    the right length, and only the frame's content checksum can tell."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 2**16, size=1500) for _ in range(4)]
    url = str(tmp_path / "raw")
    manifest = write_stream(url, docs, frame_size="1KiB")
    path = shard_path(url, manifest, 0)
    index = ShardSource.open(url).index(0)
    _flip(path, int(index.frames["comp_offset"][2]) + 1500)
    with pytest.raises(ShardCorruptError, match=manifest.shard_names[0]) as info:
        ShardSource.open(url).read(0, 2, 3)
    assert "checksum" in str(info.value)


@pytest.mark.parametrize("keep", [0.0, 0.5, -10])
def test_truncated_shard_raises_a_clear_error(small_stream, keep):
    url, _, _, manifest = small_stream
    path = shard_path(url, manifest, 2)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep) if keep >= 0 else size + keep)
    with pytest.raises(ShardCorruptError, match=manifest.shard_names[2]):
        list(read_records(url, 2))
    # Other shards are unaffected.
    assert len(list(read_records(url, 1))) == manifest.shards[1].num_records


def test_index_that_disagrees_with_the_manifest_is_refused(small_stream):
    url, _, _, manifest = small_stream
    source = ShardSource.open(url)
    source.manifest.columns["num_records"][0] += 1
    with pytest.raises(ShardCorruptError, match="manifest"):
        source.index(0)


def test_corrupt_index_magic(small_stream):
    url, _, _, manifest = small_stream
    info = manifest.shards[0]
    _flip(shard_path(url, manifest, 0), info.index_offset + 9)
    with pytest.raises(ShardCorruptError, match="index magic"):
        list(read_records(url, 0))


@pytest.mark.parametrize("verify", ["size", "sha256"])
def test_sources_of_one_stream_share_the_indexes_they_read(small_stream, verify):
    """A source that takes another's indexes reads no index itself and still checks a whole
    shard's sha256 (which hashes the index's bytes too)."""
    from streamforge.storage.config import StorageConfig

    url, _, _, manifest = small_stream
    config = StorageConfig(verify=verify)
    first = ShardSource.open(url, config=config)
    first.index(1)
    second = ShardSource(first.manifest, first.fetcher, config=config)
    second.adopt_indexes(first)
    assert second.index(1) is first.index(1)
    assert second.counters["index_requests"] == 0
    second.read(1, 0, second.index(1).num_records)  # in order from frame 0: hashed whole
    assert second.counters["shards_sha256_verified"] == (verify == "sha256")
    other = ShardSource.open(url, config=config)  # another manifest object: nothing shared
    other.adopt_indexes(first)
    assert other.counters["index_requests"] == 0 and not other.has_index(1)


@pytest.mark.parametrize("field", ["num_tokens", "meta_size"])
def test_an_index_that_puts_a_record_outside_its_frame_is_refused(small_stream, field):
    """A record the index places past its frame's end would be read cut short: the index is
    refused when it is read, naming the shard and the record."""
    url, _, metas, manifest = small_stream
    info = manifest.shards[0]
    record = next(r for r in range(info.num_records) if metas[r] is not None)  # has a meta member
    at = info.index_offset + frame_table_bytes(info.num_frames) + record * RECORD_DTYPE.itemsize
    at += RECORD_DTYPE.fields[field][1]
    with open(shard_path(url, manifest, 0), "r+b") as f:
        f.seek(at)
        f.write(struct.pack("<I", 1 << 20))
    source = ShardSource.open(url)
    with pytest.raises(ShardCorruptError, match=rf"{manifest.shard_names[0]}: index puts record {record} outside its frame"):
        source.index(0)
