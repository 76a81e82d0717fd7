"""The loader when storage fails for good, and when it skips damaged records."""

from __future__ import annotations

import pytest

from helpers.fault_proxy import FaultProxy
from helpers.storage import FAST_RETRY, batches, equal, write_corpus
from streamforge import PackedTokenDataset, Stream, StreamingLoader, unpack_state
from streamforge.errors import StorageError
from streamforge.source import ShardSource
from streamforge.storage.config import RetryPolicy, StorageConfig
from streamforge.storage.open import open_url


def _loader(url, opts, **storage):
    storage.setdefault("retry", FAST_RETRY)
    ds = PackedTokenDataset([Stream(url, name="web", storage_options=opts)], seq_len=128,
                            shuffle_buffer=64, eos_id=0, storage=StorageConfig(**storage))
    return StreamingLoader(ds, batch_size=4)






def test_state_stays_valid_when_retries_run_out(s3_corpus, s3_server):
    url, opts, _ = s3_corpus
    clean = batches(_loader(url, opts))
    proxy = FaultProxy(s3_server.endpoint_url, rate=0.0, seed=1).start()
    try:
        through = {**opts, "client_kwargs": {"endpoint_url": proxy.endpoint_url}}
        loader = _loader(url, through, prefetch_bytes=0,
                         retry=RetryPolicy(attempts=2, backoff_base=0.01, backoff_max=0.02, timeout=1.0))
        it = iter(loader)
        head = [{k: v.numpy().copy() for k, v in next(it).items()} for _ in range(5)]
        proxy.rate = 1.0  # the bucket becomes unreachable for good
        with pytest.raises(StorageError) as info:
            for batch in it:
                head.append({k: v.numpy().copy() for k, v in batch.items()})
        message = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
        assert url in message and "shard-" in message and ("frame" in message or "index" in message)
        state = loader.state_dict()  # the state of the last batch handed out
    finally:
        proxy.stop()
    assert unpack_state(state)["batch"] == len(head) and equal(head, clean[: len(head)])
    resumed = _loader(url, opts)  # storage is back
    resumed.load_state_dict(state)
    assert resumed.resume_report.mode == "exact"
    assert equal(batches(resumed), clean[len(head):])


def test_skipped_records_are_counted_and_reported(tmp_path, docs):
    url = str(tmp_path / "web")
    manifest = write_corpus(url, docs)
    source = ShardSource.open(url)
    index = source.index(1)
    at = int(index.frames["comp_offset"][1]) + int(index.frames["comp_size"][1]) // 2
    fs, path = open_url(url)
    target = f"{path}/{manifest.shard_names[1]}"
    blob = bytearray(fs.cat_file(target))
    blob[at] ^= 0x40
    fs.pipe(target, bytes(blob))
    with pytest.raises(Exception, match="shard-000001"):
        batches(_loader(url, None))
    loader = _loader(url, None, on_error="skip")
    got = batches(loader)
    lost = index.record_stop(1) - int(index.frames["first_record"][1])
    assert loader.stats()["streams"]["web"]["skipped_records"] == lost
    assert loader.skipped() and loader.skipped()[0]["shard"] == manifest.shard_names[1]
    total = sum(int((b["doc_ids"] >= 0).sum()) for b in got)
    damaged = sum(len(docs[i]) + 1 for i in range(int(manifest.first_records[1]) + int(index.frames["first_record"][1]),
                                                   int(manifest.first_records[1]) + index.record_stop(1)) if len(docs[i]))
    assert total == sum(len(d) + 1 for d in docs if len(d)) - damaged
    resumed = _loader(url, None, on_error="skip")
    resumed.load_state_dict(loader.state_dict())
    assert "skipped damaged records" in str(resumed.resume_report)
