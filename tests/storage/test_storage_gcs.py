"""GCS through gcsfs against fake-gcs-server on 127.0.0.1 (``tests/helpers/gcs_server.py``).

The storage contract tests of ``test_storage_contract.py`` are imported and run again here
with this module's ``corpus`` and ``backend`` fixtures, which put the corpus in a bucket of
the fake server (the fsspec/s3fs "derived tests" pattern; the fixtures of ``conftest.py``
stay free of GCS). Then GCS-specific checks: writing straight into the bucket, a missing
bucket, and a full loader pass and an exact resume that equal the same stream read from a
local copy.
"""

from __future__ import annotations

import pytest

from helpers.gcs_server import gcs_server  # noqa: F401  (fixture)
from helpers.storage import FAST_RETRY, batches, config, equal, read_all, same, tokens_of, write_corpus
from streamforge import PackedTokenDataset, ShardWriter, Stream, StreamingLoader
from streamforge.errors import ManifestError
from streamforge.format.manifest import Manifest, check_stream
from streamforge.source import ShardSource
from streamforge.storage.config import StorageConfig
from streamforge.storage.open import open_url
from test_storage_contract import (  # noqa: F401  (collected again, against GCS)
    test_full_stream_equals_written_docs,
    test_manifest_load_is_one_request,
    test_missing_manifest,
    test_other_format_version,
    test_ranged_reads_fetch_only_their_frames,
    test_read_records_and_pickling,
    test_reads_outside_the_plan_still_work,
)


@pytest.fixture
def backend(gcs_server):
    """``(kind, url, storage_options)`` of an empty location in a bucket of its own."""
    return "gcs", f"gs://{gcs_server.new_bucket()}/web", gcs_server.storage_options()


@pytest.fixture(scope="module")
def corpus(gcs_server, docs):
    """``(kind, url, storage_options, manifest)``: the test corpus written into the fake GCS."""
    url = f"gs://{gcs_server.new_bucket()}/web"
    opts = gcs_server.storage_options()
    manifest = write_corpus(url, docs, opts)
    assert manifest.num_shards >= 4
    return "gcs", url, opts, manifest


@pytest.fixture(scope="module")
def local_copy(corpus, tmp_path_factory):
    """The same shards and manifest, downloaded to a local directory."""
    _, url, opts, manifest = corpus
    fs, path = open_url(url, opts)
    local = tmp_path_factory.mktemp("gcs-copy") / "web"
    fs.get(f"{path}/", f"{local}/", recursive=True)
    assert len(list(local.iterdir())) == manifest.num_shards + 1  # shards and index.json
    return str(local)


def test_shard_writer_writes_straight_into_the_bucket(gcs_server, docs):
    url = f"gs://{gcs_server.new_bucket()}/web"
    opts = gcs_server.storage_options()
    with ShardWriter(url, shard_size="48KiB", frame_size="4KiB", storage_options=opts) as writer:
        for doc in docs:
            writer.write(doc)
    written = writer.close()
    manifest = Manifest.load(url, opts)
    assert manifest.fingerprint == written.fingerprint
    assert manifest.num_shards >= 4 and manifest.num_records == len(docs)
    source = ShardSource.open(url, opts, config())
    got = read_all(source)
    source.close()
    assert same(tokens_of(got), docs)
    assert [(shard, record) for shard, record, _ in got] == [
        (shard, record)
        for shard, n in enumerate(manifest.columns["num_records"].tolist())
        for record in range(n)
    ]


def test_missing_bucket(gcs_server):
    with pytest.raises(ManifestError, match="bucket 'no-such-bucket' does not exist"):
        check_stream("gs://no-such-bucket/web", gcs_server.storage_options())


def loader_for(url, opts=None):
    ds = PackedTokenDataset(
        [Stream(url, name="web", storage_options=opts)],
        seq_len=64, shuffle_buffer=32, eos_id=0,
        storage=StorageConfig(retry=FAST_RETRY, request_bytes=16 << 10),
    )
    return StreamingLoader(ds, batch_size=2, num_workers=0)






@pytest.fixture(scope="module")
def local_pass(local_copy):
    return batches(loader_for(local_copy))


def test_full_pass_equals_the_local_copy(corpus, local_pass):
    _, url, opts, _ = corpus
    assert len(local_pass) > 10
    assert equal(batches(loader_for(url, opts)), local_pass)


def test_exact_resume_from_gcs(corpus, local_pass):
    _, url, opts, _ = corpus
    loader = loader_for(url, opts)
    head = batches(loader, limit=5)
    state = loader.state_dict()
    resumed = loader_for(url, opts)
    resumed.load_state_dict(state)
    assert equal(head + batches(resumed), local_pass)
