import numpy as np

from streamforge.format.manifest import Manifest
from streamforge.format.writer import ShardWriter
from streamforge.source import read_records


def test_write_and_read_through_s3(s3_bucket, rng):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/web"
    docs = [rng.integers(0, 1000, size=int(n)) for n in rng.integers(1, 500, size=40)]
    with ShardWriter(url, shard_size="16KiB", frame_size="4KiB", storage_options=opts) as w:
        for d in docs:
            w.write(d)
    m = Manifest.load(url, storage_options=opts)
    assert m.num_records == 40 and m.num_shards > 1
    got = [t for s in range(m.num_shards) for t in read_records(url, s, storage_options=opts)]
    assert all(np.array_equal(a, b) for a, b in zip(got, docs)) and len(got) == len(docs)
