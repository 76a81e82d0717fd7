"""Storage contract: the same checks on local paths, file:// URLs and S3 (moto over HTTP)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from helpers.storage import config, read_all, same, tokens_of, write_corpus
from streamforge.errors import ConfigError, ManifestError
from streamforge.format.manifest import MANIFEST_NAME, Manifest, check_stream
from streamforge.source import ShardSource, read_records
from streamforge.source.readahead import HEAD_BYTES
from streamforge.storage import config as storage_config
from streamforge.storage.config import RetryPolicy, StorageConfig
from streamforge.storage.open import open_url


# 256 KiB: a fetch unit holds at most a quarter of the budget, compressed plus decoded, so a
# 48 KiB shard (about 80 KiB held) takes two requests
@pytest.mark.parametrize("prefetch", [0, 256 << 10])
def test_full_stream_equals_written_docs(corpus, docs, prefetch):
    _, url, opts, manifest = corpus
    source = ShardSource.open(url, opts, config(prefetch_bytes=prefetch))
    got = read_all(source)
    assert same(tokens_of(got), docs)
    stats = source.stats()
    assert stats["bytes_needed"] == int(manifest.num_bytes - manifest.columns["index_bytes"].sum())
    assert stats["bytes_fetched"] == manifest.num_bytes  # each byte exactly once
    assert stats["requests"] <= manifest.num_shards * 4 if prefetch else True
    # without read-ahead, the first shard's head is read beside its index (ReadAhead._head_now)
    # where the store is remote: its whole frames are the only ones taken ready
    frames = source.index(0).frames
    head = min(HEAD_BYTES, int(manifest.columns["index_offset"][0]))
    in_head = int((frames["comp_offset"] + frames["comp_size"] <= head).sum()) if not source.fetcher.local else 0
    assert in_head > 0 or source.fetcher.local
    assert stats["prefetch_hits"] == (stats["frames_decoded"] if prefetch else in_head)
    assert (stats["fetch_busy_s"] > 0) == bool(prefetch) and stats["prefetch_wait_s"] >= 0
    source.close()


def test_ranged_reads_fetch_only_their_frames(corpus, docs):
    _, url, opts, manifest = corpus
    source = ShardSource.open(url, opts, config(prefetch_bytes=0))
    rng = np.random.default_rng(3)
    starts = manifest.first_records
    for _ in range(20):
        shard = int(rng.integers(manifest.num_shards))
        n = int(manifest.columns["num_records"][shard])
        a = int(rng.integers(n))
        b = int(rng.integers(a + 1, n + 1))
        before = source.stats()
        batch = source.read(shard, a, b)
        after = source.stats()
        expected = docs[starts[shard] + a : starts[shard] + b]
        assert same([batch.doc(i) for i in range(len(batch))], expected)
        assert list(batch.record) == list(range(a, b))
        index = source.index(shard)
        f0, f1 = int(index.frame_of_record(a)), int(index.frame_of_record(b - 1)) + 1
        lo, hi = index.byte_range(f0, f1)
        fetched = after["bytes_fetched"] - before["bytes_fetched"]
        index_bytes = int(manifest.columns["index_bytes"][shard])
        assert fetched <= hi - lo + index_bytes  # only the frames read (and the index once)


def test_read_records_and_pickling(corpus, docs):
    _, url, opts, manifest = corpus
    got = list(read_records(url, 1, 2, 9, storage_options=opts))
    start = int(manifest.first_records[1])
    assert same(got, docs[start + 2 : start + 9])
    source = ShardSource.open(url, opts, config())
    clone = pickle.loads(pickle.dumps(source))  # before first use (DataLoader workers)
    assert same(tokens_of(read_all(clone)), docs)
    again = pickle.loads(pickle.dumps(clone))  # after use: threads and handles are dropped
    assert same(tokens_of(read_all(again, plan=False)), docs)
    clone.close()


def test_reads_outside_the_plan_still_work(corpus, docs):
    _, url, opts, manifest = corpus
    source = ShardSource.open(url, opts, config())
    source.plan_reads([(2, 0, 10), (3, 0, 5)])
    batch = source.read(0, 0, 5)  # not planned
    assert same([batch.doc(i) for i in range(5)], docs[:5])
    source.plan_reads([(1, 3, 8)])  # replaces the plan
    batch = source.read(1, 3, 8)
    start = int(manifest.first_records[1])
    assert same([batch.doc(i) for i in range(5)], docs[start + 3 : start + 8])
    source.close()


def test_missing_manifest(backend):
    kind, url, opts = backend
    fs, path = open_url(url, opts)
    fs.makedirs(path, exist_ok=True)
    if kind == "s3":
        fs.pipe(f"{path}/other.txt", b"x")  # the bucket exists, the manifest does not
    with pytest.raises(ManifestError, match=f"no {MANIFEST_NAME}"):
        check_stream(url, opts)


def test_other_format_version(backend, docs):
    kind, url, opts = backend
    write_corpus(url, docs[:20], opts)
    fs, path = open_url(url, opts)
    data = json.loads(fs.cat_file(f"{path}/{MANIFEST_NAME}"))
    data["version"] = 99
    fs.pipe(f"{path}/{MANIFEST_NAME}", json.dumps(data).encode())
    with pytest.raises(ManifestError, match="format version 99"):
        ShardSource.open(url, opts)


def test_missing_bucket(s3_server):
    opts = s3_server.storage_options()
    with pytest.raises(ManifestError, match="bucket 'no-such-bucket' does not exist"):
        check_stream("s3://no-such-bucket/web", opts)


def test_no_credentials(s3_server, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    opts = {"client_kwargs": {"endpoint_url": s3_server.endpoint_url}, "skip_instance_cache": True}
    with pytest.raises(ManifestError, match="no usable credentials"):
        check_stream(f"s3://{s3_server.new_bucket()}/web", opts)


def test_config_is_validated():
    with pytest.raises(ConfigError, match="verify"):
        StorageConfig(verify="md5")
    with pytest.raises(ConfigError, match="on_error"):
        StorageConfig(on_error="ignore")
    with pytest.raises(ConfigError, match="cache_dir"):
        StorageConfig(cache_limit=10)
    with pytest.raises(ConfigError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ConfigError, match="jitter"):
        RetryPolicy(jitter=2.0)


def test_read_ahead_defaults_follow_the_backend(corpus, docs):
    """Unset, the read-ahead budget and threads are chosen by where the stream lives: a
    shallow one-thread read-ahead for local files, a deep one for an object store. Set, they
    are used as given, anywhere."""
    _, url, opts, _ = corpus
    local = not url.startswith("s3://")
    source = ShardSource.open(url, opts, config(prefetch_bytes=None, prefetch_threads=None))
    assert source.fetcher.local is local
    assert same(tokens_of(read_all(source)), docs)
    pf = source._readahead.prefetcher
    assert (pf.budget, pf.threads) == ((32 << 20, 1) if local else (64 << 20, 4))  # read in this process
    source.close()
    assert StorageConfig(prefetch_bytes=1 << 20, prefetch_threads=3).read_ahead(local) == (1 << 20, 3)
    assert StorageConfig(prefetch_bytes=0).read_ahead(local)[0] == 0
    with pytest.raises(ConfigError, match="prefetch_threads"):
        StorageConfig(prefetch_threads=0)
    with pytest.raises(ConfigError, match="prefetch_bytes"):
        StorageConfig(prefetch_bytes=-1)


def test_manifest_load_is_one_request(corpus):
    _, url, opts, manifest = corpus
    loaded = Manifest.load(url, opts)
    assert loaded.fingerprint == manifest.fingerprint


def test_one_filesystem_per_process_and_options(s3_server, tmp_path):
    opts = s3_server.storage_options()
    policy = RetryPolicy()
    a, path_a = open_url("s3://bucket/web", opts, policy)
    b, path_b = open_url("s3://bucket/code/shard-000001.tar.zst", opts, policy)
    assert a is b and (path_a, path_b) == ("bucket/web", "bucket/code/shard-000001.tar.zst")
    assert open_url("s3://bucket/web", opts)[0] is not a  # other client settings: another client
    other = {**opts, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    assert open_url("s3://bucket/web", other, policy)[0] is not a
    local, path = open_url(f"file://{tmp_path}/web")
    assert path == f"{tmp_path}/web" and open_url(str(tmp_path))[0] is local


class _ReadAheadIn(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield StorageConfig().read_ahead(True), StorageConfig().read_ahead(False)


def _read_ahead_in_workers(workers: int) -> list[tuple]:
    loader = torch.utils.data.DataLoader(_ReadAheadIn(), batch_size=None, num_workers=workers)
    return [(tuple(local), tuple(remote)) for local, remote in loader]


def test_local_read_ahead_defaults_to_less_in_a_dataloader_worker(monkeypatch):
    """In the training process (0 workers) a local stream reads 32 MiB ahead: its reader also
    builds the batch contract, and waits for frames a smaller budget leaves undecoded; a
    DataLoader worker with a core for its fetch thread reads 8 MiB ahead, which buys it as
    much (docs/storage.md)."""
    monkeypatch.setattr(storage_config, "usable_cores", lambda: 4)  # the forked worker sees it too
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert StorageConfig().read_ahead(True) == (32 << 20, 1)
    assert _read_ahead_in_workers(1) == [((8 << 20, 1), (64 << 20, 4))]
    assert StorageConfig(prefetch_bytes=4 << 20).read_ahead(True)[0] == 4 << 20


@pytest.mark.parametrize("cores, workers, local_ranks, ahead", [
    (2, 1, None, True), (2, 2, None, False), (4, 2, None, True), (4, 2, "2", False), (8, 2, "2", True),
    (3, 2, "x", False),  # a LOCAL_WORLD_SIZE that is not a count reads as one rank
])
def test_a_worker_without_a_core_for_its_fetch_thread_reads_local_frames_itself(monkeypatch, cores, workers,
                                                                                 local_ranks, ahead):
    """Local read-ahead in a DataLoader worker takes a core beside the worker's own: where
    the node's worker processes (its ranks' workers, LOCAL_WORLD_SIZE as torchrun sets it)
    have fewer than two cores each, a worker decodes its local frames itself (0 bytes ahead;
    docs/storage.md gives the figures). An object store keeps its read-ahead, which waits
    on the network rather than on a core, and a budget that is set is kept."""
    monkeypatch.setattr(storage_config, "usable_cores", lambda: cores)
    if local_ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    local = (8 << 20, 1) if ahead else (0, 1)
    assert _read_ahead_in_workers(workers) == [(local, (64 << 20, 4))] * workers
    assert StorageConfig().read_ahead(True) == (32 << 20, 1)  # the training process: unchanged


def test_spare_core_counts_two_cores_a_worker_process_on_the_node():
    assert storage_config.spare_core(cores=16, workers=8, local_ranks=1)
    assert not storage_config.spare_core(cores=16, workers=8, local_ranks=2)
    assert storage_config.spare_core(cores=2, workers=0, local_ranks=0)  # counts below one read as one
    assert 1 <= storage_config.usable_cores()
