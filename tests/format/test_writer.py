"""ShardWriter: sizes, cut points, input validation, and never clobbering another dataset."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.format import write_stream
from streamforge.errors import ConfigError
from streamforge.format.manifest import MANIFEST_NAME, Manifest
from streamforge.format.writer import ShardWriter, choose_token_dtype, cut_points, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        (65536, 65536), ("65536", 65536), ("64MiB", 64 << 20), ("256KiB", 256 << 10),
        ("256Ki", 256 << 10), ("1k", 1000), ("1KB", 1000), ("2 GB", 2 * 10**9), ("1.5MiB", 3 << 19),
        ("7b", 7), (" 3 m ", 3 * 10**6), ("1TiB", 1 << 40), (np.int64(5), 5),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["0", 0, -1, "abc", "12 XB", "", "1.5.2MiB", "-3KiB"])
def test_parse_size_refuses(text):
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 10**6), st.sampled_from(["", "b", "k", "KB", "M", "MiB", "KiB", "g", "GiB"]))
def test_parse_size_property(number, unit):
    mult = {"": 1, "b": 1, "k": 10**3, "KB": 10**3, "M": 10**6, "MiB": 2**20, "KiB": 2**10,
            "g": 10**9, "GiB": 2**30}[unit]
    assert parse_size(f"{number}{unit}") == number * mult


def test_cut_points_examples():
    assert cut_points([], 10) == []
    assert cut_points([5, 5, 5], 10) == [0, 2]
    assert cut_points([11, 1, 1], 10) == [0, 1]  # an oversized item stands alone
    assert cut_points([0, 0, 10, 0, 1], 10) == [0, 4]
    assert cut_points([3, 3, 3], 1) == [0, 1, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100), max_size=60), st.integers(1, 250))
def test_cut_points_are_greedy_groups(sizes, target):
    starts = cut_points(sizes, target)
    if not sizes:
        assert starts == []
        return
    assert starts[0] == 0 and starts == sorted(set(starts))
    bounds = starts[1:] + [len(sizes)]
    for lo, hi in zip(starts, bounds):
        group = sizes[lo:hi]
        assert group, "every group holds at least one item"
        # Only an item that arrives in an empty (zero-byte) group may overshoot the target.
        assert sum(group) <= target or sum(group[:-1]) == 0
        if hi < len(sizes):  # greedy: the next item would not have fit
            assert sum(group) + sizes[hi] > target and sum(group) > 0


def test_choose_token_dtype():
    assert choose_token_dtype(65535) == "uint16"
    assert choose_token_dtype(10, vocab_size=65537) == "uint32"
    assert choose_token_dtype(65536) == "uint32"
    with pytest.raises(ConfigError):
        choose_token_dtype(2**32)


@pytest.mark.parametrize(
    "kwargs, bad, message",
    [
        ({}, np.zeros((2, 3), np.int64), r"record 2: tokens must be 1-D"),
        ({}, np.array([1, -4]), r"record 2: token id -4 outside uint16"),
        ({}, np.array([70000]), r"record 2: token id 70000 outside uint16"),
        ({"vocab_size": 100}, np.array([5, 100]), r"record 2: token id 100 outside vocab_size 100"),
        ({}, np.array([1.5, 2.0]), r"record 2: tokens must be integers"),
    ],
)
def test_bad_documents_are_refused_naming_the_record(tmp_path, kwargs, bad, message):
    writer = ShardWriter(str(tmp_path / "s"), **kwargs)
    writer.write([1, 2])
    writer.write([])
    with pytest.raises(ConfigError, match=message):
        writer.write(bad)
    assert writer.write([3]) == 2  # the refused document took no record index


def test_uint32_takes_large_ids(tmp_path):
    manifest = write_stream(tmp_path / "s", [np.array([0, 2**32 - 1])], token_dtype="uint32")
    assert manifest.token_dtype == "uint32"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"token_dtype": "int32"}, "token_dtype"),
        ({"vocab_size": 70000}, "vocab_size 70000"),
        ({"shard_size": "big"}, "size"),
        ({"frame_size": 0}, "size"),
    ],
)
def test_bad_writer_arguments(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ShardWriter(str(tmp_path / "s"), **kwargs)


def test_write_after_close_and_empty_stream(tmp_path):
    writer = ShardWriter(str(tmp_path / "s"))
    writer.write([1])
    manifest = writer.close()
    assert writer.close() is manifest  # closing twice is harmless
    with pytest.raises(ConfigError, match="after close"):
        writer.write([2])
    with pytest.raises(ConfigError, match="no documents"):
        ShardWriter(str(tmp_path / "empty")).close()
    assert not os.path.exists(tmp_path / "empty" / MANIFEST_NAME)


def test_exception_inside_with_leaves_no_manifest(tmp_path):
    url = tmp_path / "s"
    with pytest.raises(RuntimeError):
        with ShardWriter(str(url), shard_size=1) as writer:
            writer.write([1, 2])
            writer.write([3])
            raise RuntimeError("conversion interrupted")
    assert os.path.exists(url / "shard-000000.tar.zst")
    assert not os.path.exists(url / MANIFEST_NAME)


def test_existing_different_dataset_is_refused(tmp_path):
    url = str(tmp_path / "s")
    old = write_stream(url, [[1, 2, 3]], source_fingerprint="old")
    with pytest.raises(ConfigError, match=r"already holds a different dataset \(1 shards, 1 records, source fingerprint old\)"):
        ShardWriter(url, source_fingerprint="new")
    with pytest.raises(ConfigError, match="different dataset"):
        ShardWriter(url)  # no fingerprint: cannot be shown to be the same
    assert Manifest.load(url).fingerprint == old.fingerprint


def test_same_source_may_be_written_again(tmp_path):
    url = str(tmp_path / "s")
    first = write_stream(url, [[1, 2, 3], [4]], source_fingerprint="same")
    again = write_stream(url, [[1, 2, 3], [4]], source_fingerprint="same")
    assert again.fingerprint == first.fingerprint


def test_overwrite_keeps_the_old_stream_until_close(tmp_path):
    url = str(tmp_path / "s")
    old = write_stream(url, [[1, 2, 3]], source_fingerprint="old")
    files = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()}
    writer = ShardWriter(url, source_fingerprint="new", overwrite=True, shard_size=1)
    writer.write([7, 8])
    writer.write([9])  # the first shard is written, under a name the old manifest does not list
    # Until close() the prefix opens as the old stream, its files untouched.
    assert {n: (tmp_path / "s" / n).read_bytes() for n in files} == files
    assert Manifest.load(url).fingerprint == old.fingerprint
    writer.close()
    manifest = Manifest.load(url)
    assert manifest.source_fingerprint == "new" and manifest.num_records == 2
    assert manifest.shard_names == ["shard-000000.g1.tar.zst", "shard-000001.g1.tar.zst"]
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [MANIFEST_NAME, *manifest.shard_names]


def test_unreadable_manifest_counts_as_a_different_dataset(tmp_path):
    url = tmp_path / "s"
    url.mkdir()
    (url / MANIFEST_NAME).write_text("not json")
    with pytest.raises(ConfigError, match="unreadable manifest"):
        ShardWriter(str(url), source_fingerprint="x")
    with ShardWriter(str(url), source_fingerprint="x", overwrite=True) as writer:
        writer.write([1])
    assert Manifest.load(str(url)).source_fingerprint == "x"
