"""index.json: what it records, and how a bad one is refused (always naming its url)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.format import random_docs, write_stream
from streamforge.errors import ManifestError
from streamforge.format.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, shard_name


@pytest.fixture
def stream(tmp_path):
    url = str(tmp_path / "web")
    docs = random_docs(np.random.default_rng(0), 30)
    manifest = write_stream(
        url, docs, shard_size="4KiB", frame_size="1KiB", eos_id=999, vocab_size=1000,
        docs_end_with_eos=False, conversion={"source": "test"}, source_fingerprint="src-1",
    )
    return url, docs, manifest


def _rewrite(url, edit):
    path = f"{url}/{MANIFEST_NAME}"
    data = json.loads(open(path).read())
    edit(data)
    open(path, "w").write(json.dumps(data))


def test_manifest_records_the_stream(stream):
    url, docs, written = stream
    loaded = Manifest.load(url)
    data = json.loads(open(f"{url}/{MANIFEST_NAME}").read())
    assert data["format"] == "streamforge" and data["version"] == FORMAT_VERSION
    assert data["token_dtype"] == "uint16" and data["eos_id"] == 999 and data["vocab_size"] == 1000
    assert data["num_records"] == len(docs) == loaded.num_records
    assert data["num_tokens"] == sum(d.size for d in docs) == loaded.num_tokens
    assert data["num_shards"] == loaded.num_shards == written.num_shards > 1
    assert data["source_fingerprint"] == "src-1"
    assert data["conversion"] == {"source": "test", "shard_size": 4096, "frame_size": 1024, "compression_level": 3}
    # Columnar shard table: one list per field, one entry per shard.
    table = data["shards"]
    assert set(table) == {"name", "sha256", "bytes", "num_records", "num_tokens", "num_frames", "index_offset", "index_bytes", "num_docs"}
    assert {len(v) for v in table.values()} == {loaded.num_shards}
    assert table["name"] == [shard_name(i) for i in range(loaded.num_shards)]
    for info in loaded.shards:
        assert info.index_offset + info.index_bytes == info.bytes
    assert loaded.first_records.tolist() == np.concatenate([[0], np.cumsum(table["num_records"])[:-1]]).tolist()
    assert loaded.fingerprint == written.fingerprint
    assert loaded.url == url


def test_json_round_trip_is_exact(stream):
    url, _, _ = stream
    blob = open(f"{url}/{MANIFEST_NAME}", "rb").read()
    assert Manifest.loads(blob).dumps() == blob


def test_missing_prefix(tmp_path):
    url = str(tmp_path / "nothing-here")
    with pytest.raises(ManifestError, match="nothing-here.*no index.json"):
        Manifest.load(url)


def test_malformed_json(stream):
    url, _, _ = stream
    open(f"{url}/{MANIFEST_NAME}", "w").write('{"format": "streamforge", ')
    with pytest.raises(ManifestError, match=f"{url}: not valid JSON"):
        Manifest.load(url)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(version=FORMAT_VERSION + 1), f"format version {FORMAT_VERSION + 1}"),
        (lambda d: d.update(format="mds"), "not a streamforge manifest"),
        (lambda d: d.update(num_records=d["num_records"] + 1), "num_records says"),
        (lambda d: d.update(num_tokens=0), "num_tokens says"),
        (lambda d: d.update(num_shards=1), "num_shards says"),
        (lambda d: d["shards"].pop("num_frames"), "malformed shard table"),
        (lambda d: d["shards"]["bytes"].pop(), "different lengths"),
        (lambda d: d.update(token_dtype="int8"), "token_dtype 'int8'"),
    ],
)
def test_bad_manifest_is_refused_naming_the_url(stream, edit, message):
    url, _, _ = stream
    _rewrite(url, edit)
    with pytest.raises(ManifestError, match=message) as info:
        Manifest.load(url)
    assert str(info.value).startswith(url)


def test_manifest_error_is_a_value_error():
    with pytest.raises(ValueError):
        Manifest.loads(b"[]", "mem://x")
