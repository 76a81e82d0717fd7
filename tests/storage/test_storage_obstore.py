"""S3 reads through obstore (``StorageConfig.client``): the same bytes as s3fs, the same errors,
the same retries, and a forked worker that reads over plain HTTP instead of hanging (real S3
server on 127.0.0.1)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from helpers.storage import config, read_all, same, tokens_of, write_corpus
from streamforge.errors import ConfigError, ManifestError, ShardCorruptError, StorageError
from streamforge.format.manifest import Manifest
from streamforge.source import ShardSource
from streamforge.storage import objstore
from streamforge.storage.config import RetryPolicy, StorageConfig
from streamforge.storage.open import open_url

pytest.importorskip("obstore", reason="obstore is an optional extra (pip install 'streamforge[obstore]')")


def _reader_kind(url, opts, client):
    fs, _ = open_url(url, opts, RetryPolicy(), client)
    return "obstore" if isinstance(fs, objstore.ObstoreReader) else "fsspec"


def test_auto_reads_s3_through_obstore_and_fsspec_on_request(s3_corpus):
    url, opts, _ = s3_corpus
    assert _reader_kind(url, opts, "auto") == "obstore"
    assert _reader_kind(url, opts, "obstore") == "obstore"
    assert _reader_kind(url, opts, "fsspec") == "fsspec"
    assert _reader_kind("/tmp/x", None, "obstore") == "fsspec"  # local paths never


def test_both_clients_read_the_same_records(s3_corpus, docs):
    url, opts, _ = s3_corpus
    fast = ShardSource.open(url, opts, config(client="obstore"))
    slow = ShardSource.open(url, opts, config(client="fsspec"))
    assert isinstance(fast.fetcher._open()[0], objstore.ObstoreReader)
    a, b = read_all(fast), read_all(slow)
    assert same(tokens_of(a), docs) and same(tokens_of(a), tokens_of(b))
    assert fast.stats()["bytes_fetched"] == slow.stats()["bytes_fetched"] > 0
    assert fast.stats()["obstore_requests"] == fast.stats()["requests"] > 0  # which client answered
    assert slow.stats()["obstore_requests"] == 0 < slow.stats()["requests"]
    fast.close()
    slow.close()


@pytest.mark.parametrize(
    "options, why",
    [
        ({"profile": "dev"}, r"\['profile'\] have no obstore counterpart"),
        ({"client_kwargs": {"verify": False}}, r"client_kwargs \['verify'\]"),
        ({"config_kwargs": {"signature_version": "s3v4"}}, r"config_kwargs \['signature_version'\]"),
    ],
)
def test_options_obstore_cannot_honour_fall_back_or_are_refused(s3_server, options, why):
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/web"
    opts = {**s3_server.storage_options(), **options}
    if "client_kwargs" in options:
        opts["client_kwargs"] = {**s3_server.storage_options()["client_kwargs"], **options["client_kwargs"]}
    assert objstore.obstore_settings(opts)[1] is not None
    assert _reader_kind(url, opts, "auto") == "fsspec"
    with pytest.raises(ConfigError, match=rf"{url}: StorageConfig.client='obstore' cannot be used: .*{why}"):
        open_url(url, opts, RetryPolicy(), "obstore")


def test_credentials_and_region_come_from_the_options_or_the_environment(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
                 "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    config_, why = objstore.obstore_settings({"key": "k", "secret": "s", "client_kwargs": {"region_name": "eu-west-1"}})
    assert why is None and config_ == {"access_key_id": "k", "secret_access_key": "s", "region": "eu-west-1",
                                       "virtual_hosted_style_request": True}
    assert "no key and secret" in objstore.obstore_settings({"client_kwargs": {"region_name": "eu-west-1"}})[1]
    assert "no region and no endpoint" in objstore.obstore_settings({"key": "k", "secret": "s"})[1]
    assert objstore.obstore_settings({"anon": True, "endpoint_url": "http://h:1"})[0] == {
        "skip_signature": True, "endpoint": "http://h:1", "region": "us-east-1"}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ek")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "es")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "et")
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    assert objstore.obstore_settings({})[0] == {"access_key_id": "ek", "secret_access_key": "es",
                                                "session_token": "et", "region": "us-west-2",
                                                "virtual_hosted_style_request": True}


def test_a_bad_client_name_is_refused():
    with pytest.raises(ConfigError, match="client must be one of"):
        StorageConfig(client="boto")


def test_missing_manifest_and_bucket_are_named(s3_server):
    opts = s3_server.storage_options()
    bucket = s3_server.new_bucket()
    with pytest.raises(ManifestError, match=rf"s3://{bucket}/nothing: no index.json"):
        Manifest.load(f"s3://{bucket}/nothing", opts, client="obstore")
    with pytest.raises(ManifestError, match="bucket 'no-such-bucket' does not exist"):
        Manifest.load("s3://no-such-bucket/web", opts, client="obstore")


def test_a_truncated_shard_is_named_not_retried(s3_server, docs):
    url = f"s3://{s3_server.new_bucket()}/web"
    opts = s3_server.storage_options()
    manifest = write_corpus(url, docs, opts)
    fs, path = open_url(url, opts)  # s3fs: the writer's side
    target = f"{path}/{manifest.shard_names[1]}"
    fs.pipe(target, fs.cat_file(target)[:-2000])
    source = ShardSource.open(url, opts, config(client="obstore", prefetch_bytes=0))
    with pytest.raises(ShardCorruptError, match=rf"{manifest.shard_names[1]}.*shard is \d+ bytes, the manifest says"):
        read_all(source)
    assert source.stats()["retries"] == 0
    source.close()


def test_a_refused_connection_is_retried_then_reported(s3_server):
    opts = {**s3_server.storage_options(), "client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}
    policy = RetryPolicy(attempts=3, backoff_base=0.01, backoff_max=0.02, timeout=1.0)
    with pytest.raises(StorageError, match="index.json: giving up after 3 attempts"):
        Manifest.load("s3://bucket/web", opts, retry=policy, client="obstore")


def _child_reads(url, opts, client, queue):
    source = ShardSource.open(url, opts, config(client=client))
    kind = type(source.fetcher._open()[0]).__name__
    queue.put((kind, [t.tolist() for t in tokens_of(read_all(source))]))


@pytest.mark.parametrize("client", ["obstore", "auto"])
def test_a_process_forked_after_obstore_requests_reads_over_http(s3_corpus, docs, client):
    """obstore's runtime does not survive fork: the child must not touch it (it would hang)."""
    url, opts, _ = s3_corpus
    parent = ShardSource.open(url, opts, config(client=client))
    parent.index(0)  # the parent's obstore client has made requests
    assert objstore._RUNTIME_PID is not None
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_reads, args=(url, opts, client, queue))
    proc.start()
    kind, tokens = queue.get(timeout=60)
    proc.join(60)
    assert proc.exitcode == 0
    assert kind == "S3HttpReader"  # storage/s3http.py, even under client="obstore"
    assert [list(map(int, d)) for d in docs] == tokens
    parent.close()


def _loader(url, opts, client, num_workers=0, context=None):
    from helpers.storage import FAST_RETRY
    from streamforge import PackedTokenDataset, Stream, StreamingLoader

    ds = PackedTokenDataset([Stream(url, name="web", storage_options=opts)], seq_len=128, seed=0,
                            shuffle_buffer=64, eos_id=0,
                            storage=StorageConfig(retry=FAST_RETRY, request_bytes=16 << 10, client=client))
    return StreamingLoader(ds, batch_size=4, num_workers=num_workers, multiprocessing_context=context)


def test_loader_passes_equal_across_clients_and_worker_start_methods(s3_corpus):
    """Spawned workers read through obstore themselves; forked ones over plain HTTP."""
    from helpers.storage import batches, equal

    url, opts, _ = s3_corpus
    for workers, context in ((0, None), (2, None), (1, "spawn")):
        reference = batches(_loader(url, opts, "fsspec", workers))  # the order depends on the workers
        assert len(reference) > 10
        loader = _loader(url, opts, "obstore", workers, context)
        assert equal(batches(loader), reference), (workers, context)
        # stats() says which client read: all obstore in one process or spawned workers; in
        # forked workers HTTP, the trainer's head start alone through obstore
        stats = loader.stats()["streams"]["web"]
        forked = workers > 0 and context is None
        assert 0 < stats["obstore_requests"] < stats["requests"] if forked else (
            stats["obstore_requests"] == stats["requests"] > 0), (workers, context, stats)
        assert stats["obstore_requests"] + stats["http_requests"] == stats["requests"], (workers, context, stats)


def test_a_dotted_bucket_on_aws_is_read_path_style():
    reader = objstore.ObstoreReader({"access_key_id": "a", "secret_access_key": "b", "region": "eu-west-1",
                                     "virtual_hosted_style_request": True}, RetryPolicy())
    dotted, key = reader._split("s3://my.bucket/web/index.json")
    plain, _ = reader._split("s3://plain/web/index.json")
    assert key == "web/index.json"
    assert str(dotted.config["virtual_hosted_style_request"]).lower() == "false"
    assert str(plain.config["virtual_hosted_style_request"]).lower() == "true"
