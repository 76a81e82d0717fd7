"""Uncompressed .tar shards: same layout, frames stored raw, readable by every path."""

import subprocess
import tarfile

import numpy as np
import pytest

from streamforge import Manifest, PackedTokenDataset, ShardWriter, StreamingLoader, read_records
from streamforge.format.verify import verify_stream


def _write(url, docs, compression):
    with ShardWriter(url, shard_size="4KiB", frame_size="1KiB", eos_id=0, compression=compression) as w:
        for d in docs:
            w.write(d)


def test_plain_tar_round_trip_and_stock_tools(tmp_path, rng):
    docs = [rng.integers(1, 1000, size=int(n)).astype(np.uint16) for n in rng.integers(0, 300, size=60)]
    url = str(tmp_path / "plain")
    _write(url, docs, "none")
    m = Manifest.load(url)
    assert m.compression == "none" and all(n.endswith(".tar") for n in m.shard_names)
    got = [t for s in range(m.num_shards) for t in read_records(url, s)]
    assert len(got) == len(docs) and all(np.array_equal(a, b) for a, b in zip(got, docs))
    with tarfile.open(tmp_path / "plain" / m.shard_names[0]) as tar:  # the index after the archive is ignored
        names = tar.getnames()
    assert names[0] == "000000000000.npy"
    listing = subprocess.run(["tar", "-tf", str(tmp_path / "plain" / m.shard_names[0])], capture_output=True, text=True)
    assert listing.returncode == 0 and listing.stdout.split() == names
    assert verify_stream(url) == []


def test_plain_tar_gives_the_same_batches_as_zstd(tmp_path, rng):
    docs = [rng.integers(1, 1000, size=int(n)).astype(np.uint16) for n in rng.integers(1, 300, size=80)]
    batches = {}
    for codec in ("none", "zstd"):
        url = str(tmp_path / codec)
        _write(url, docs, codec)
        loader = StreamingLoader(PackedTokenDataset(url, seq_len=64, shuffle_buffer=16), batch_size=2)
        batches[codec] = [b["input_ids"].clone() for b in loader]
    assert len(batches["none"]) == len(batches["zstd"])
    for a, b in zip(batches["none"], batches["zstd"]):
        assert (a == b).all()


def test_unknown_compression_is_refused(tmp_path):
    from streamforge import ConfigError

    with pytest.raises(ConfigError, match="compression"):
        ShardWriter(str(tmp_path / "x"), compression="lz4")
