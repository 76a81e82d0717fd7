import numpy as np

from helpers.convert import assert_same_docs, random_docs, read_stream, write_megatron
from streamforge.convert import convert
from streamforge.format.verify import verify_stream


def test_convert_straight_into_s3_and_read_back(tmp_path, rng, s3_bucket):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/stream"
    docs = random_docs(rng, 120, max_len=800)
    write_megatron(tmp_path / "c", docs)
    m = convert("megatron", tmp_path / "c", url, shard_size="32KiB", workers=2,
                storage_options=opts)
    assert m.num_shards > 2
    manifest, records = read_stream(url, opts)
    assert_same_docs(records, docs)
    assert manifest.fingerprint == m.fingerprint
    assert verify_stream(url, opts) == []
    local = convert("megatron", tmp_path / "c", tmp_path / "local", shard_size="32KiB")
    assert local.shard_sha256 == m.shard_sha256
