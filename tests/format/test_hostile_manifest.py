"""Hostile and junk manifests are refused on load with a ManifestError naming the stream, the
shard and the field: counts, duplicates, sizes past what a shard can hold, and shard names
that would read outside the stream's prefix (locally and on the loopback S3 server)."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.format import random_docs, write_stream
from streamforge.errors import ManifestError, ShardCorruptError
from streamforge.format.manifest import MANIFEST_NAME, Manifest
from streamforge.source import ShardSource
from streamforge.storage.open import open_url


@pytest.fixture
def stream(tmp_path):
    url = str(tmp_path / "web")
    docs = random_docs(np.random.default_rng(5), 40)
    manifest = write_stream(url, docs, shard_size="4KiB", frame_size="1KiB", eos_id=999, vocab_size=1000)
    assert manifest.num_shards >= 3
    return url, manifest


def _rewrite(url, edit, storage_options=None):
    fs, path = open_url(url, storage_options)
    data = json.loads(fs.cat_file(f"{path}/{MANIFEST_NAME}"))
    edit(data)
    fs.pipe(f"{path}/{MANIFEST_NAME}", json.dumps(data).encode())
    return data


def _set(column, shard, value):
    def edit(data):
        data["shards"][column][shard] = value(data["shards"][column][shard]) if callable(value) else value
    return edit


def _refused(url, pattern, storage_options=None):
    with pytest.raises(ManifestError, match=pattern) as info:
        Manifest.load(url, storage_options)
    assert str(info.value).startswith(url), info.value
    return str(info.value)


# -- counts (issue 35, item 6) --------------------------------------------------------------------
@pytest.mark.parametrize(
    "column, value, said",
    [
        # each was silent: 436 all-padding batches, a dropped shard, a shard delivered twice
        ("num_docs", lambda n: n * 1000, r"num_docs is \d+, must be 0..num_records"),
        ("num_records", -1, r"num_records is -1, must be 0\.\."),
        ("num_tokens", -5, r"num_tokens is -5, must be 0\.\."),
        ("num_frames", 0, r"num_frames is 0, must be 1\.\."),
        ("bytes", 0, r"bytes is 0, must be 1\.\."),
        ("index_offset", -1, r"index_offset is -1, must be >= 0"),
        ("index_bytes", 3 << 30, r"index_bytes is 3221225472, must be \d+ for an index of \d+ frames"),
        ("num_frames", lambda n: n + 1, r"index_bytes is \d+, must be \d+ for an index of \d+ frames"),
        ("index_offset", lambda n: n + 1000, r"index_offset is \d+, must be bytes - index_bytes"),
        ("num_records", 1 << 40, r"num_records is 1099511627776, must be 0\.\.4294967295"),
        ("num_tokens", 2**62, r"num_tokens is 4611686018427387904, must be 0\.\."),
        ("bytes", 2**64, r"bytes is 18446744073709551616, must be an integer"),
        ("num_records", 1.5, r"num_records is 1.5, must be an integer"),
        ("num_records", "7", r"num_records is '7', must be an integer"),
        ("num_frames", [1, 2], r"num_frames is a list, must be an integer"),
        ("num_docs", None, r"num_docs is None, must be an integer"),
        ("sha256", "ab" * 31, r"sha256 is '.*', must be 64 lowercase hex digits"),
    ],
)
def test_a_count_or_size_out_of_range_is_refused_naming_shard_and_field(stream, column, value, said):
    url, manifest = stream
    _rewrite(url, _set(column, 1, value))
    message = _refused(url, said)
    assert f"shard 1 ({manifest.shard_names[1]}): {column}" in message or "index_bytes" in said


def test_the_issue_examples_name_stream_shard_and_field(stream):
    url, manifest = stream
    _rewrite(url, _set("num_records", 0, -1))
    assert _refused(url, "num_records") == (
        f"{url}: shard 0 ({manifest.shard_names[0]}): num_records is -1, must be 0..4294967295"
    )


def test_a_shard_listed_twice_is_refused(stream):
    url, manifest = stream

    def twice(data):
        for values in data["shards"].values():
            values.append(values[0])
        data["num_shards"] += 1
        data["num_records"] += data["shards"]["num_records"][0]
        data["num_tokens"] += data["shards"]["num_tokens"][0]
        data["num_bytes"] += data["shards"]["bytes"][0]

    _rewrite(url, twice)
    n = manifest.num_shards
    _refused(url, rf"shard {n} \({manifest.shard_names[0]}\): name is listed twice \(also shard 0\)")


@pytest.mark.parametrize(
    "edit, said",
    [
        (lambda d: d.update(num_bytes=d["num_bytes"] + 1), "num_bytes says"),
        (lambda d: d.update(num_records=-3), "num_records is -3, must be an integer >= 0"),
        (lambda d: d.update(eos_id=-1), r"eos_id is -1, must be null or an integer in 0..65535"),
        (lambda d: d.update(eos_id=70_000), r"eos_id is 70000, must be null or an integer in 0..65535"),
        (lambda d: d.update(vocab_size=0), "vocab_size is 0"),
        (lambda d: d.update(docs_end_with_eos="yes"), "docs_end_with_eos is 'yes'"),
        (lambda d: d.update(conversion=[1]), "conversion is a list"),
        (lambda d: d.update(token_dtype=["uint16"]), "token_dtype a list not in"),
        (lambda d: d.update(shards=[]), r"malformed shard table \(shards is a list"),
        (lambda d: d["shards"].update(name="shard-000000.tar.zst"), r"shards.name is 'shard-000000.tar.zst', must be a list"),
        (lambda d: d["shards"]["num_docs"].pop(), r"different lengths \(.*num_docs \d+\)"),
    ],
)
def test_header_fields_are_checked(stream, edit, said):
    url, _ = stream
    _rewrite(url, edit)
    _refused(url, said)


def test_an_old_manifest_without_num_docs_still_loads(stream):
    url, manifest = stream
    _rewrite(url, lambda d: d["shards"].pop("num_docs"))
    assert Manifest.load(url).num_records == manifest.num_records


# -- shard names (issue 35, item 7) ---------------------------------------------------------------
HOSTILE_NAMES = [
    "../secret/shard-000000.tar.zst",
    "..",
    "/etc/passwd",
    "/dev/zero",
    "s3://other-bucket/key",
    "file:///etc/passwd",
    "sub/shard-000000.tar.zst",
    "sub\\shard-000000.tar.zst",
    "~root",
    ".hidden",
    "",
    "shard\n-000000.tar.zst",
    "shard-000000.tar.zst\x00",
    "a" * 201,
    "shard..tar",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_shard_name_outside_the_prefix_is_refused(stream, name):
    url, _ = stream
    _rewrite(url, _set("name", 2, name))
    _refused(url, r"shard 2: name .* is not a plain file name in the stream's prefix")


def test_traversal_reads_nothing_outside_the_stream(stream, tmp_path):
    """The issue's case: a name reaching ``../secret/`` was read; now nothing is opened."""
    url, manifest = stream
    secret = tmp_path / "secret"
    secret.mkdir()
    os.replace(f"{url}/{manifest.shard_names[0]}", secret / manifest.shard_names[0])
    _rewrite(url, _set("name", 0, f"../secret/{manifest.shard_names[0]}"))
    with pytest.raises(ManifestError, match=r"shard 0: name '\.\./secret/"):
        ShardSource.open(url).read(0, 0, 1)


@pytest.mark.parametrize("client", ["http", "auto"])
def test_traversal_on_s3_is_refused(s3_server, client):
    """On S3 ``../../other-bucket/key`` reached another bucket through the signed-HTTP client;
    the manifest check refuses the name before any request."""
    from streamforge.storage.config import StorageConfig

    opts = s3_server.storage_options()
    bucket, other = s3_server.new_bucket(), s3_server.new_bucket("other")
    url = f"s3://{bucket}/web"
    manifest = write_stream(url, random_docs(np.random.default_rng(1), 20), shard_size="4KiB",
                            storage_options=opts)
    fs, _ = open_url(url, opts)
    fs.pipe(f"{other}/{manifest.shard_names[0]}", fs.cat_file(f"{bucket}/web/{manifest.shard_names[0]}"))
    _rewrite(url, _set("name", 0, f"../../{other}/{manifest.shard_names[0]}"), opts)
    with pytest.raises(ManifestError, match=rf"s3://{bucket}/web: shard 0: name '\.\./\.\./{other}/"):
        ShardSource.open(url, opts, StorageConfig(client=client))


# -- junk --------------------------------------------------------------------------------------
def _junk_values():
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True), st.text(max_size=30),
    )
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)


_FIELDS = ["token_dtype", "compression", "eos_id", "vocab_size", "docs_end_with_eos", "num_shards",
           "num_records", "num_tokens", "num_bytes", "shards", "conversion", "tokenizer", "source_fingerprint"]
_COLUMNS = ["name", "sha256", "bytes", "num_records", "num_tokens", "num_frames", "index_offset",
            "index_bytes", "num_docs"]


@pytest.fixture(scope="module")
def good_manifest(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("junk") / "web")
    manifest = write_stream(url, random_docs(np.random.default_rng(2), 30), shard_size="4KiB", eos_id=7)
    return json.loads(manifest.dumps())


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_junk_in_any_field_is_a_manifest_error(good_manifest, data):
    """Any value in any field, or in any one shard's entry of any column, raises ManifestError
    (never a bare OverflowError, TypeError, RecursionError or StopIteration) or loads exactly
    as written (never 1.5 read as 1)."""
    doc = json.loads(json.dumps(good_manifest))
    if data.draw(st.booleans()):
        doc[data.draw(st.sampled_from(_FIELDS))] = data.draw(_junk_values())
    else:
        column = doc["shards"][data.draw(st.sampled_from(_COLUMNS))]
        column[data.draw(st.integers(0, len(column) - 1))] = data.draw(_junk_values())
    try:
        loaded = Manifest.loads(json.dumps(doc).encode(), "mem://junk")
    except ManifestError as exc:
        assert str(exc).startswith("mem://junk: ")
        return
    assert loaded.to_json()["shards"] == doc["shards"]


@pytest.mark.parametrize(
    "blob, said",
    [
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b'{"format": "streamforge", "version": 1, "token_dtype": "uint16", "shards": ' + b"[" * 500 + b"]" * 500 + b"}", "malformed shard table"),
        (b"1e999999", "not a streamforge manifest"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_junk_json_is_a_manifest_error(blob, said):
    with pytest.raises(ManifestError, match=said):
        Manifest.loads(blob, "mem://junk")


def test_a_junk_100k_shard_manifest_is_refused_fast_naming_the_field(good_manifest):
    n = 100_000
    doc = json.loads(json.dumps(good_manifest))
    row = {k: v[0] for k, v in doc["shards"].items()}
    doc["shards"] = {k: [row[k]] * n for k in row}
    doc["shards"]["name"] = [f"shard-{i:06d}.tar.zst" for i in range(n)]
    doc.update(num_shards=n, num_records=row["num_records"] * n, num_tokens=row["num_tokens"] * n,
               num_bytes=row["bytes"] * n)
    Manifest.loads(json.dumps(doc).encode(), "mem://big")  # sane: loads
    for column, i, value, said in [
        ("num_tokens", 99_999, 10**30, "num_tokens is 1000000000000000000000000000000, must be an integer"),
        ("name", 54_321, "../x", r"shard 54321: name '\.\./x'"),
        ("sha256", 7, None, "sha256 is None"),
        ("num_docs", 12_345, [[[[]]]], "num_docs is a list"),
    ]:
        bad = json.loads(json.dumps(doc))
        bad["shards"][column][i] = value
        start = time.perf_counter()
        with pytest.raises(ManifestError, match=said):
            Manifest.loads(json.dumps(bad).encode(), "mem://big")
        assert time.perf_counter() - start < 10


def test_a_fifo_for_index_json_is_refused_not_waited_on(tmp_path):
    url = tmp_path / "web"
    url.mkdir()
    os.mkfifo(url / MANIFEST_NAME)
    out = []

    def load():  # in a thread: a reader that waits on the FIFO fails the test, not hangs it
        try:
            Manifest.load(str(url))
        except Exception as exc:  # noqa: BLE001 - checked below
            out.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and len(out) == 1, "Manifest.load blocked on a FIFO"
    assert isinstance(out[0], ManifestError)
    assert re.search(r"index.json.*is a FIFO, not a regular file", str(out[0])), out[0]


def test_shard_corrupt_is_not_raised_for_a_sound_stream(stream):
    url, manifest = stream
    source = ShardSource.open(url)
    for shard in range(manifest.num_shards):
        try:
            source.read(shard, 0, int(manifest.columns["num_records"][shard]))
        except ShardCorruptError as exc:  # pragma: no cover - the failure message is the point
            pytest.fail(str(exc))
