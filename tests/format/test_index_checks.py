"""A shard's record index is checked when it is read: a flipped bit anywhere in it, counts that
disagree with the manifest, or a record longer than a self-consistent index says raise
ShardCorruptError naming the stream, the shard and the record or field, never wrong tokens."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from helpers.format import shard_path, write_stream
from streamforge.errors import ShardCorruptError
from streamforge.format.frames import RECORD_DTYPE, decode_index, encode_index, frame_table_bytes
from streamforge.format.manifest import MANIFEST_NAME, Manifest
from streamforge.format.tar import npy_header_size
from streamforge.format.verify import verify_stream
from streamforge.source import ShardSource, read_records


def _read_shard(url, shard):
    source = ShardSource.open(url)
    n = int(source.manifest.columns["num_records"][shard])
    batch = source.read(shard, 0, n)
    return [batch.doc(i).copy() for i in range(len(batch))]


@pytest.fixture
def tiny(tmp_path):
    """One shard of 6 records (two with metadata) in 3 frames: a 164-byte index."""
    rng = np.random.default_rng(11)
    docs = [rng.integers(0, 1000, size=n) for n in (40, 0, 300, 7, 120, 90)]
    metas = [None, {"a": 1}, None, None, {"b": [1, 2]}, None]
    url = str(tmp_path / "tiny")
    manifest = write_stream(url, docs, metas, frame_size="1KiB", eos_id=999)
    assert manifest.num_shards == 1 and manifest.shards[0].num_frames >= 3
    return url, docs, manifest


def _record_field_at(info, record, field):
    return (info.index_offset + frame_table_bytes(info.num_frames) + record * RECORD_DTYPE.itemsize
            + RECORD_DTYPE.fields[field][1])


def _xor(path, offset, mask):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


@pytest.mark.parametrize(
    "record, field, mask, said",
    [
        # (the case: each gave a pass of wrong tokens, no error)
        (2, "token_offset", 0x02, r"index record 2: token_offset is \d+, the records before it in frame \d+ put it at \d+"),
        (0, "token_offset", 0x40, r"index record 0: token_offset is \d+"),
        (2, "num_tokens", 0x01, r"index records' num_tokens sum to \d+, its header and the manifest say \d+"),
        (4, "meta_offset", 0x04, r"index record 4: meta_offset is \d+"),
        # (same padded size: only the .json member's tar header can tell, when the frame decodes)
        (4, "meta_size", 0x01, r"record 4: its \.json member has a tar header of 11 bytes where the index puts one of 10"),
    ],
)
def test_a_flipped_bit_in_a_record_is_refused_naming_stream_shard_and_record(tiny, record, field, mask, said):
    url, _, manifest = tiny
    _xor(shard_path(url, manifest, 0), _record_field_at(manifest.shards[0], record, field), mask)
    with pytest.raises(ShardCorruptError, match=said) as info:
        _read_shard(url, 0)
    assert str(info.value).startswith(f"{url}/{manifest.shard_names[0]}")


def test_every_single_bit_flip_in_the_index_is_refused(tiny):
    """Exhaustive: each of the index's bits flipped in turn; no read returns wrong tokens."""
    url, docs, manifest = tiny
    info = manifest.shards[0]
    path = shard_path(url, manifest, 0)
    clean = open(path, "rb").read()
    accepted = []
    for bit in range(info.index_bytes * 8):
        with open(path, "wb") as f:
            blob = bytearray(clean)
            blob[info.index_offset + bit // 8] ^= 1 << (bit % 8)
            f.write(blob)
        try:
            got = _read_shard(url, 0)
        except ShardCorruptError:
            continue
        accepted.append((bit, all(np.array_equal(a, b) for a, b in zip(got, docs)) and len(got) == len(docs)))
    assert accepted == [], f"flips read without an error (bit, tokens right): {accepted}"


def test_index_counts_are_cross_checked_with_the_manifest(tiny):
    url, _, manifest = tiny
    path = f"{url}/{MANIFEST_NAME}"
    data = json.loads(open(path).read())
    data["shards"]["num_docs"][0] -= 1  # still within the manifest's own bounds
    open(path, "w").write(json.dumps(data))
    with pytest.raises(ShardCorruptError, match=rf"{manifest.shard_names[0]}: index holds \d+ non-empty records, manifest num_docs \d+"):
        ShardSource.open(url).index(0)


def _lengthen_a_record(url, manifest, record):
    """Rewrite shard 0 so that ``record``'s tar member holds one token more than the index,
    the index header and the manifest say, everything else consistent (sizes, offsets, sums,
    sha256): the record's padded size is the same either way."""
    path = shard_path(url, manifest, 0)
    blob = bytearray(open(path, "rb").read())
    info = manifest.shards[0]
    index = decode_index(bytes(blob[info.index_offset:]), "x")
    records = index.records.copy()
    records["num_tokens"][record] -= 1
    blob[info.index_offset:] = encode_index(index.frames, records, index.num_tokens - 1)
    open(path, "wb").write(blob)
    data = json.loads(open(f"{url}/{MANIFEST_NAME}").read())
    data["shards"]["num_tokens"][0] -= 1
    data["num_tokens"] -= 1
    data["shards"]["sha256"][0] = hashlib.sha256(blob).hexdigest()
    open(f"{url}/{MANIFEST_NAME}", "w").write(json.dumps(data))


def test_a_record_longer_than_a_consistent_index_says_is_refused(tmp_path):
    rng = np.random.default_rng(3)
    n = 100  # 128-byte .npy header + 200 bytes of tokens: 99 tokens pad to the same block
    assert npy_header_size(n, np.dtype("<u2")) == npy_header_size(n - 1, np.dtype("<u2"))
    docs = [rng.integers(0, 1000, size=k) for k in (30, n, 50)]
    url = str(tmp_path / "long")
    manifest = write_stream(url, docs, frame_size="64KiB")
    assert verify_stream(url) == []
    _lengthen_a_record(url, manifest, 1)
    Manifest.load(url)  # the manifest and the index agree with each other
    ShardSource.open(url).index(0)  # ... and the index with itself
    with pytest.raises(ShardCorruptError, match=(
        rf"{url}/{manifest.shard_names[0]} frame 0 record 1: its \.npy member has a tar header of "
        rf"\d+ bytes where the index puts one of \d+ bytes"
    )):
        _read_shard(url, 0)
    with pytest.raises(ShardCorruptError, match=r"record 1: its \.npy member"):
        list(read_records(url, 0, 1, 2))  # the few-records path (frame table and rows only)
    problems = verify_stream(url)
    assert any("frame 0 record 1: its .npy member has a tar header" in p for p in problems), problems
    assert all(p.startswith(manifest.shard_names[0]) for p in problems)


def test_verify_reports_an_index_flip_the_counts_do_not_show(tiny):
    url, _, manifest = tiny
    info = manifest.shards[0]
    _xor(shard_path(url, manifest, 0), _record_field_at(info, 3, "token_offset"), 0x08)
    problems = verify_stream(url)
    assert any(p.startswith(f"{manifest.shard_names[0]}: index record 3: token_offset") for p in problems), problems


def test_an_index_past_the_end_of_a_local_file_fails_at_once(tiny):
    """A range past the file's end is damage, not a transient fault: no retries."""
    url, _, manifest = tiny
    path = shard_path(url, manifest, 0)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 10)
    source = ShardSource.open(url)
    with pytest.raises(ShardCorruptError, match=rf"{manifest.shard_names[0]} index: shard is {size - 10} bytes"):
        source.index(0)
    assert source.fetcher.retries == 0


@pytest.mark.parametrize("read_ahead", [True, False])
def test_a_record_longer_than_its_index_says_is_refused_through_the_loader(tmp_path, read_ahead):
    """The tar check of a frame runs where the frame is decoded: on the read-ahead's thread,
    which hands a frame that fails it over undecoded, so the reader fails it again with its
    error policy (raise: the error names the record; skip: the frame's records are left out,
    the rest of the pass is read)."""
    from streamforge import PackedTokenDataset, StorageConfig, StreamingLoader

    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 1000, size=k) for k in (30, 100, 50)] + [rng.integers(0, 1000, 400) for _ in range(40)]
    url = str(tmp_path / "long")
    manifest = write_stream(url, docs, frame_size="2KiB")
    _lengthen_a_record(url, manifest, 1)
    prefetch = {} if read_ahead else {"prefetch_bytes": 0}

    def one_pass(on_error):
        ds = PackedTokenDataset(url, seq_len=64, seed=0, eos_id=0,
                                storage=StorageConfig(on_error=on_error, **prefetch))
        loader = StreamingLoader(ds, batch_size=2)
        return loader, sum(int((b["doc_ids"] >= 0).sum()) for b in loader)

    with pytest.raises(ShardCorruptError, match=r"frame 0 record 1: its \.npy member has a tar header"):
        one_pass("raise")
    loader, tokens = one_pass("skip")
    skipped = loader.skipped()
    assert len(skipped) == 1 and "frame 0 record 1: its .npy member" in str(skipped[0]), skipped
    assert 0 < tokens <= sum(len(d) + 1 for d in docs[2:])  # frame 0 (records 0 and 1) left out
