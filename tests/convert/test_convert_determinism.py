import hashlib
import shutil

import numpy as np

from helpers.convert import random_docs, write_megatron
from streamforge.convert import convert


def digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_repeated_and_parallel_conversions_are_identical(tmp_path, rng):
    docs = random_docs(rng, 400, max_len=600)
    prefix = write_megatron(tmp_path / "c", docs)
    kw = dict(shard_size="32KiB", frame_size="8KiB")
    a = convert("megatron", prefix, tmp_path / "a", workers=1, **kw)
    b = convert("megatron", prefix, tmp_path / "b", workers=1, **kw)
    c = convert("megatron", prefix, tmp_path / "c3", workers=3, **kw)
    assert a.num_shards > 6
    da, db, dc = digests(tmp_path / "a"), digests(tmp_path / "b"), digests(tmp_path / "c3")
    assert da == db == dc  # every shard and index.json
    assert "index.json" in da and len(da) == a.num_shards + 1
    assert a.shard_sha256 == c.shard_sha256


def test_fingerprint_follows_content_not_path(tmp_path, rng):
    docs = random_docs(rng, 30)
    write_megatron(tmp_path / "one", docs)
    (tmp_path / "elsewhere").mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(tmp_path / f"one{ext}", tmp_path / "elsewhere" / f"two{ext}")
    a = convert("megatron", tmp_path / "one", tmp_path / "a")
    b = convert("megatron", tmp_path / "elsewhere" / "two", tmp_path / "b")
    assert a.source_fingerprint == b.source_fingerprint
    docs[3] = docs[3] + 1
    write_megatron(tmp_path / "three", docs)
    c = convert("megatron", tmp_path / "three", tmp_path / "c")
    assert c.source_fingerprint != a.source_fingerprint


def test_same_source_may_be_rewritten_but_not_another(tmp_path, rng):
    import pytest

    from streamforge.errors import ConfigError

    write_megatron(tmp_path / "x", random_docs(rng, 10, zero_frac=0))
    write_megatron(tmp_path / "y", random_docs(rng, 10, zero_frac=0))
    first = convert("megatron", tmp_path / "x", tmp_path / "out")
    again = convert("megatron", tmp_path / "x", tmp_path / "out")  # same bytes again: allowed
    assert again.fingerprint == first.fingerprint  # under the next generation of shard names
    assert again.shard_sha256 == first.shard_sha256 and again.shard_names != first.shard_names
    before = digests(tmp_path / "out")
    with pytest.raises(ConfigError, match="already holds a different dataset"):
        convert("megatron", tmp_path / "y", tmp_path / "out")
    assert digests(tmp_path / "out") == before
    convert("megatron", tmp_path / "y", tmp_path / "out", overwrite=True)
    after = digests(tmp_path / "out")
    assert after["index.json"] != before["index.json"]
    assert not (set(after) & set(before)) - {"index.json"}  # no shard file written over
