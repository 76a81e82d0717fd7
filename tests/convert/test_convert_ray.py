"""The Ray engine on a real local cluster (two CPUs, loopback only): text read from and shards
written to the loopback S3 server, byte-identical to local processes with one and two workers."""

from __future__ import annotations

import subprocess
import sys

import pytest

ray = pytest.importorskip(
    "ray", reason="Ray is not installed here (no wheel for this platform/Python); "
    "pip install 'streamforge[ray]' to run the Ray engine tests"
)
pytest.importorskip("tokenizers", reason="text conversion tests need the 'text' extra (tokenizers)")

from helpers.convert import read_stream  # noqa: E402
from helpers.text import make_docs, split_files, train_hf, tree_digests, write_text_parquet  # noqa: E402

from streamforge.convert import convert  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def cached(opts):
    """The bucket's options with fsspec's instance cache on: each worker process then builds
    one S3 client per conversion instead of one per file it opens."""
    return {k: v for k, v in opts.items() if k != "skip_instance_cache"}


def s3fs_of(opts):
    import s3fs

    return s3fs.S3FileSystem(**opts)


def test_ray_writes_the_same_bytes_as_local_workers(tmp_path, rng, s3_bucket, ray_cluster):
    bucket, opts = s3_bucket
    fs = s3fs_of(opts)
    docs = make_docs(rng, 900)
    split_files(tmp_path / "in", docs, 4, ".jsonl.gz")
    write_text_parquet(tmp_path / "docs.parquet", docs, row_group_size=300)
    train_hf(tmp_path / "tokenizer.json", docs)
    fs.put(str(tmp_path / "in"), f"{bucket}/in", recursive=True)
    fs.put(str(tmp_path / "docs.parquet"), f"{bucket}/pq/docs.parquet")
    fs.put(str(tmp_path / "tokenizer.json"), f"{bucket}/tok/tokenizer.json")
    tok = f"s3://{bucket}/tok/tokenizer.json"
    common = dict(text_field="text", tokenizer=tok, shard_size="64KiB", storage_options=cached(opts),
                  progress=False)
    outs = {}
    for name, kw in (("w1", dict(workers=1)), ("w2", dict(workers=2)), ("ray", dict(engine="ray"))):
        m = convert("jsonl", f"s3://{bucket}/in", f"s3://{bucket}/{name}", **common, **kw)
        outs[name] = tree_digests(fs, f"{bucket}/{name}")
    assert outs["w1"] == outs["w2"] == outs["ray"]
    assert m.num_records == 900 and m.num_shards >= 4
    assert ray.is_initialized()  # the engine used the session it found and left it running
    assert len(read_stream(f"s3://{bucket}/ray", opts)[1]) == 900

    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": 1}\n')
    from streamforge.errors import SourceError

    with pytest.raises(SourceError, match=r"bad.jsonl:2: no field 'text'"):
        convert("jsonl", tmp_path / "bad.jsonl", f"s3://{bucket}/bad", engine="ray", **common)
    assert not fs.exists(f"{bucket}/bad/index.json")

    a = convert("parquet", f"s3://{bucket}/pq", f"s3://{bucket}/pq-ray", engine="ray", **common)
    b = convert("parquet", f"s3://{bucket}/pq", f"s3://{bucket}/pq-w2", workers=2, **common)
    assert a.conversion["num_slices"] == 3 and a.shard_sha256 == b.shard_sha256


def test_cli_joins_a_running_cluster_by_address(tmp_path, rng, ray_cluster, s3_bucket):
    docs = make_docs(rng, 200)
    split_files(tmp_path / "in", docs, 2)
    tok = train_hf(tmp_path / "tokenizer.json", docs)
    bucket, opts = s3_bucket
    endpoint = opts["client_kwargs"]["endpoint_url"]
    args = ["convert", "--from", "jsonl", "--input", str(tmp_path / "in"), "--text-field", "text",
            "--tokenizer", tok, "--shard-size", "16KiB", "--endpoint-url", endpoint,
            "--storage-option", "key=testing", "--storage-option", "secret=testing"]
    run = subprocess.run(
        [sys.executable, "-m", "streamforge.cli", *args, "--output", f"s3://{bucket}/cli",
         "--engine", "ray", "--ray-address", ray_cluster],
        capture_output=True, text=True, timeout=180,
    )
    assert run.returncode == 0, run.stderr
    assert "200 records" in run.stdout and "skipped rows: 0" in run.stdout
    local = convert("jsonl", tmp_path / "in", tmp_path / "local", text_field="text", tokenizer=tok,
                    shard_size="16KiB", progress=False)
    assert read_stream(f"s3://{bucket}/cli", opts)[0].shard_sha256 == local.shard_sha256
