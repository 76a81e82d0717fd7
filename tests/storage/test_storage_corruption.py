"""Damaged shards: a flipped byte, a truncated shard, a wrong sha256; both on_error policies."""

from __future__ import annotations

import json

import pytest

from helpers.storage import config, read_all, same, tokens_of, write_corpus
from streamforge.errors import ShardCorruptError
from streamforge.format.manifest import MANIFEST_NAME
from streamforge.source import ShardSource
from streamforge.storage.open import open_url


@pytest.fixture(params=["local", "s3"])
def damaged(request, tmp_path, s3_server, docs):
    """``(url, opts, manifest, damage)``: a fresh corpus and a function that damages it."""
    if request.param == "local":
        url, opts = str(tmp_path / "web"), None
    else:
        url, opts = f"s3://{s3_server.new_bucket()}/web", s3_server.storage_options()
    manifest = write_corpus(url, docs, opts)
    fs, path = open_url(url, opts)

    def damage(shard: int, edit) -> None:
        target = f"{path}/{manifest.shard_names[shard]}"
        fs.pipe(target, edit(bytearray(fs.cat_file(target))))

    return url, opts, manifest, damage


def flip_in_frame(source, shard, frame):
    index = source.index(shard)
    at = int(index.frames["comp_offset"][frame]) + int(index.frames["comp_size"][frame]) // 2

    def edit(blob):
        blob[at] ^= 0x40
        return bytes(blob)

    records = (int(index.frames["first_record"][frame]), index.record_stop(frame))
    return edit, records


@pytest.mark.parametrize("prefetch", [0, 64 << 10])
def test_flipped_byte(damaged, docs, prefetch):
    url, opts, manifest, damage = damaged
    edit, (lo, hi) = flip_in_frame(ShardSource.open(url, opts), 1, 2)
    damage(1, edit)
    with pytest.raises(ShardCorruptError, match=r"shard-000001.tar.zst frame 2 records \d+..\d+"):
        read_all(ShardSource.open(url, opts, config(prefetch_bytes=prefetch)))
    source = ShardSource.open(url, opts, config(prefetch_bytes=prefetch, on_error="skip"))
    got = read_all(source)
    first = int(manifest.first_records[1])
    expected = docs[: first + lo] + docs[first + hi :]
    assert same(tokens_of(got), expected)
    assert all(not (s == 1 and lo <= r < hi) for s, r, _ in got)
    [entry] = source.skipped
    assert (entry["shard"], entry["frame"], entry["start"], entry["stop"]) == (
        manifest.shard_names[1], 2, lo, hi)
    assert source.stats()["skipped_records"] == hi - lo


def test_truncated_shard(damaged, docs, caplog):
    url, opts, manifest, damage = damaged
    damage(2, lambda blob: bytes(blob[: len(blob) // 2]))
    with pytest.raises(ShardCorruptError, match="shard-000002.tar.zst.*truncated"):
        read_all(ShardSource.open(url, opts, config()))
    source = ShardSource.open(url, opts, config(on_error="skip"))
    got = read_all(source)
    a, n = int(manifest.first_records[2]), int(manifest.columns["num_records"][2])
    assert same(tokens_of(got), docs[:a] + docs[a + n :])
    assert source.stats()["skipped_records"] == n
    assert {e["shard"] for e in source.skipped} == {manifest.shard_names[2]}
    assert "skipping" in caplog.text and "shard-000002" in caplog.text


def test_sha256_mismatch_only_with_sha256(damaged, docs):
    url, opts, manifest, _ = damaged
    fs, path = open_url(url, opts)
    data = json.loads(fs.cat_file(f"{path}/{MANIFEST_NAME}"))
    data["shards"]["sha256"][3] = "0" * 64
    fs.pipe(f"{path}/{MANIFEST_NAME}", json.dumps(data).encode())
    assert same(tokens_of(read_all(ShardSource.open(url, opts, config()))), docs)
    with pytest.raises(ShardCorruptError, match="shard-000003.tar.zst.*sha256"):
        read_all(ShardSource.open(url, opts, config(verify="sha256")))
    source = ShardSource.open(url, opts, config(verify="sha256", on_error="skip"))
    got = read_all(source)
    assert [e["shard"] for e in source.skipped] == [manifest.shard_names[3]]
    assert all(s != 3 or r < source.skipped[0]["start"] for s, r, _ in got)
    assert source.stats()["shards_sha256_verified"] == manifest.num_shards - 1
