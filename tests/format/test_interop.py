"""Shards are readable by stock tools: the zstd CLI, tar, Python's tarfile, webdataset."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

import numpy as np
import zstandard

from helpers.format import ZSTD_CLI, needs_zstd_cli, shard_path
from streamforge.format.tar import NPY_ALIGN, record_key


def expected_members(manifest, metas, shard):
    first = manifest.shards[shard].first_record
    names = []
    for r in range(first, first + manifest.shards[shard].num_records):
        names.append(f"{record_key(r)}.npy")
        if metas[r] is not None:
            names.append(f"{record_key(r)}.json")
    return names


def decompress_all(path):
    """All frames of a shard, the skippable index frame ignored, as zstd -dc does."""
    with open(path, "rb") as f:
        reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
        return reader.read()


@needs_zstd_cli
def test_zstd_cli_and_tar_list_the_members(small_stream):
    url, _, metas, manifest = small_stream
    for shard in range(manifest.num_shards):
        listing = subprocess.run(
            f"{ZSTD_CLI} -dcq '{shard_path(url, manifest, shard)}' | tar -t",
            shell=True, check=True, capture_output=True, text=True,
        ).stdout.split()
        assert listing == expected_members(manifest, metas, shard)


def test_python_tarfile_reads_the_decompressed_shard(small_stream):
    url, docs, metas, manifest = small_stream
    shard = 1
    raw = decompress_all(shard_path(url, manifest, shard))
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == expected_members(manifest, metas, shard)
        assert {(m.mtime, m.uid, m.gid, m.mode) for m in members} == {(0, 0, 0, 0o644)}
        first = manifest.shards[shard].first_record
        for member in members:
            record = int(member.name.split(".")[0])
            payload = tar.extractfile(member).read()
            if member.name.endswith(".npy"):
                array = np.load(io.BytesIO(payload))
                assert array.dtype == np.dtype("uint16") and np.array_equal(array, docs[record])
                # Token data starts 64-byte aligned inside the member.
                assert (len(payload) - array.nbytes) % NPY_ALIGN == 0
                assert (member.offset_data + len(payload) - array.nbytes) % NPY_ALIGN == 0
            else:
                assert json.loads(payload) == metas[record]
        assert first == int(members[0].name.split(".")[0])


@needs_zstd_cli
def test_webdataset_pipe_yields_the_samples(small_stream):
    import webdataset as wds

    url, docs, metas, manifest = small_stream
    urls = [f"pipe:{ZSTD_CLI} -dcq '{shard_path(url, manifest, s)}'" for s in range(manifest.num_shards)]
    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    samples = list(dataset)
    assert [int(s["__key__"]) for s in samples] == list(range(len(docs)))
    for sample in samples:
        record = int(sample["__key__"])
        tokens = np.load(io.BytesIO(sample["npy"]))
        assert np.array_equal(tokens, docs[record])
        if metas[record] is None:
            assert "json" not in sample
        else:
            assert json.loads(sample["json"]) == metas[record]


@needs_zstd_cli
def test_webdataset_decode_gives_arrays(small_stream):
    import webdataset as wds

    url, docs, _, manifest = small_stream
    dataset = wds.WebDataset(
        f"pipe:{ZSTD_CLI} -dcq '{shard_path(url, manifest, 0)}'", shardshuffle=False
    ).decode()
    first = next(iter(dataset))
    assert np.array_equal(first["npy"], docs[0])
