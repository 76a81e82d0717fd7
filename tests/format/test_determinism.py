"""Same documents and parameters -> byte-identical shards and manifest."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from helpers.format import random_docs, write_stream
from streamforge.format.tar import record_key, tar_header


def _files(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def test_same_input_gives_byte_identical_files(tmp_path):
    docs = random_docs(np.random.default_rng(7), 80)
    metas = [{"i": i, "lang": "en"} if i % 3 == 0 else None for i in range(len(docs))]
    params = dict(shard_size="10KiB", frame_size="3KiB", eos_id=0, vocab_size=1000)
    a = write_stream(tmp_path / "a", docs, metas, **params)
    b = write_stream(tmp_path / "b", docs, metas, **params)
    files_a, files_b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert files_a == files_b
    assert "index.json" in files_a and len(files_a) == a.num_shards + 1
    assert a.fingerprint == b.fingerprint
    # The manifest's sha256 column is the digest of each shard file.
    for name, digest in zip(a.shard_names, a.shard_sha256):
        assert files_a[name] == digest


def test_fingerprint_ignores_the_location_and_follows_the_content(tmp_path):
    docs = random_docs(np.random.default_rng(8), 20)
    a = write_stream(tmp_path / "a", docs, shard_size="4KiB")
    b = write_stream(tmp_path / "elsewhere" / "b", docs, shard_size="4KiB")
    c = write_stream(tmp_path / "c", docs[:-1] + [docs[-1] + 1], shard_size="4KiB")
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != c.fingerprint


def test_tar_headers_are_fixed_apart_from_name_and_size():
    header = tar_header(f"{record_key(5)}.npy", 1234)
    assert len(header) == 512
    assert header[:16] == b"000000000005.npy"
    assert header[136:148] == b"00000000000\0"  # mtime 0
    assert header[108:124] == b"0000000\0" * 2  # uid, gid 0
    assert header[257:265] == b"ustar\x0000"
    assert tar_header(f"{record_key(5)}.npy", 1234) == header
