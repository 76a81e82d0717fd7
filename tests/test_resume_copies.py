"""Seeds and fingerprints come from names and content, never URLs: a copy resumes exactly."""

import json
import shutil

import numpy as np

from helpers.pipeline import assert_batches_equal, dataset, loader, random_docs, take, write_stream
from streamforge import PackedTokenDataset, Stream, StreamingLoader
from streamforge.storage.config import StorageConfig


def test_state_from_local_copy_resumes_on_s3_copy(tmp_path, s3_bucket):
    import s3fs

    bucket, opts = s3_bucket
    rng = np.random.default_rng(11)
    local = {}
    for name, median in (("web", 50), ("code", 150)):
        url = str(tmp_path / name)
        local[name] = (url, write_stream(url, random_docs(rng, 120, median)))
    fs = s3fs.S3FileSystem(**opts)
    for name, (url, _) in local.items():
        fs.put(url, f"{bucket}/{name}", recursive=True)
    reference = take(loader(dataset(local, weights=[0.6, 0.4]), num_workers=2), 40)
    first = loader(dataset(local, weights=[0.6, 0.4]), num_workers=2)
    take(first, 13)
    state = json.loads(json.dumps(first.state_dict()))
    streams = [Stream(f"s3://{bucket}/{n}", weight=w, name=n, storage_options=opts) for n, w in (("web", 0.6), ("code", 0.4))]
    on_s3 = StreamingLoader(PackedTokenDataset(streams, seq_len=64, shuffle_buffer=32, shuffle_warmup=4), batch_size=2,
                            num_workers=2)
    on_s3.load_state_dict(state)
    assert on_s3.resume_report.mode == "exact"
    assert_batches_equal(take(on_s3, 27), reference[13:40])


def test_resume_reads_only_what_the_cursors_point_at(tmp_path):
    rng = np.random.default_rng(2)
    url = str(tmp_path / "web")
    write_stream(url, random_docs(rng, 3000, 100), shard_size="64KiB", frame_size="4KiB")
    corpus = {"web": (url, None)}
    no_prefetch = StorageConfig(prefetch_bytes=0)  # count only what the cursors ask for
    first = loader(dataset(corpus, shuffle_buffer=64, storage=no_prefetch), batch_size=4)
    batches = take(first, 1000)  # late in the pass
    fetched_before = first.stats()["streams"]["web"]["bytes_fetched"]
    resumed = loader(dataset(corpus, shuffle_buffer=64, storage=no_prefetch), batch_size=4)
    resumed.load_state_dict(first.state_dict())
    take(resumed, 1)
    fetched_resume = resumed.stats()["streams"]["web"]["bytes_fetched"]
    assert len(batches) == 1000
    # one shuffle window (64 documents ~ 6.4k tokens) and its frames, not the ~400k tokens before it
    assert fetched_resume < fetched_before / 10, (fetched_resume, fetched_before)


def test_moved_directory_resumes_exactly(tmp_path):
    rng = np.random.default_rng(4)
    url = str(tmp_path / "a" / "web")
    write_stream(url, random_docs(rng, 100, 80))
    reference = take(loader(dataset({"web": (url, None)})), 30)
    first = loader(dataset({"web": (url, None)}))
    take(first, 9)
    moved = str(tmp_path / "b" / "web")
    shutil.copytree(url, moved)
    resumed = loader(dataset({"web": (moved, None)}))
    resumed.load_state_dict(first.state_dict())
    assert resumed.resume_report.mode == "exact"
    assert_batches_equal(take(resumed, 21), reference[9:30])
