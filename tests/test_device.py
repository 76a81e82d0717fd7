"""Device prefetch (streamforge/device.py) on CPU: the feed runs on a real background thread
with real DataLoader workers; the loader's state is that of the last batch handed out, so a
resume under prefetch is exact. The CUDA-only parts are in test_cuda.py."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from helpers.pipeline import assert_batches_equal, dataset, loader, make_corpus, take
from streamforge import ConfigError, PackedTokenDataset, Stream, unpack_state
from streamforge.loader.device import DeviceFeed, check_depth, default_device
from streamforge.loader.workers import WorkerBatch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("device"), np.random.default_rng(7))


def _feed_threads():
    return [t for t in threading.enumerate() if t.name == "streamforge-device-feed"]


def _scheduled(corpus):
    """The test corpus with a mixture schedule that switches at step 6."""
    streams = [Stream(url, name=name) for name, (url, _) in corpus.items()]
    weights = [(0, {"web": 0.6, "code": 0.3, "books": 0.1}), (6, {"web": 0.2, "code": 0.3, "books": 0.5})]
    return PackedTokenDataset(streams, seq_len=64, shuffle_buffer=32, weights=weights)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact_with_batches_in_flight(corpus, num_workers):
    reference = take(loader(_scheduled(corpus), num_workers=num_workers))
    assert len(reference) > 12
    for cut in (1, 9):
        first = loader(_scheduled(corpus), num_workers=num_workers, device_prefetch=3)
        it = iter(first)
        head = [{k: v.clone() for k, v in next(it).items()} for _ in range(cut)]
        time.sleep(0.05)  # let the feed run ahead: 3 batches wait in its queue
        assert first.step == cut  # the clock counts batches handed out, not prepared
        state = json.loads(json.dumps(first.state_dict()))
        plain = loader(_scheduled(corpus), num_workers=num_workers)
        plain_it = iter(plain)
        for _ in range(cut):
            next(plain_it)
        want = plain.state_dict()
        got, ref = unpack_state(state)["ranks"][0], unpack_state(want)["ranks"][0]
        assert got["workers"] == ref["workers"] and got["counters"] == ref["counters"]
        del it, plain_it
        resumed = loader(_scheduled(corpus), num_workers=num_workers, device_prefetch=2)
        resumed.load_state_dict(state, strict=True)
        assert resumed.resume_report.mode == "exact"
        assert_batches_equal(head + take(resumed), reference)
        assert resumed.stats()["phases"] == loader_stats(corpus, num_workers)["phases"]


def loader_stats(corpus, num_workers):
    ldr = loader(_scheduled(corpus), num_workers=num_workers)
    take(ldr)
    return ldr.stats()


def test_feed_thread_stops_when_the_consumer_breaks(corpus):
    before = len(_feed_threads())
    ldr = loader(dataset(corpus), num_workers=2, device_prefetch=2)
    it = iter(ldr)
    next(it)
    assert len(_feed_threads()) == before + 1
    it.close()
    assert len(_feed_threads()) == before
    assert ldr.step == 1
    assert_batches_equal(take(ldr, 3), take(loader(dataset(corpus), num_workers=2), 4)[1:])


def test_an_error_in_the_pipeline_reaches_the_trainer():
    def raw():
        yield WorkerBatch(0, 0, "rows-0", None)
        raise OSError("shard 3 is gone")

    feed = DeviceFeed(lambda rows: {"x": torch.tensor([len(rows)])}, torch.device("cpu"), 2)
    take = feed.open(raw())
    got = take()
    assert got.item.rows == "rows-0"
    assert feed.hand_out(got)["x"].item() == 6
    with pytest.raises(OSError, match="shard 3 is gone"):
        take()
    feed.close()
    assert not _feed_threads()


def test_depth_is_checked_and_defaults_by_device(corpus):
    assert check_depth(None, torch.device("cpu")) == 0
    assert check_depth(None, torch.device("cuda", 0)) == 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="device_prefetch"):
            loader(dataset(corpus), device_prefetch=bad)
    if not torch.cuda.is_available():
        assert default_device() == torch.device("cpu")
        assert loader(dataset(corpus)).device_prefetch == 0
