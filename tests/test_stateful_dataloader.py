"""torchdata's StatefulDataLoader resumes PackedTokenDataset by cursor, in every worker.

``iter(dataset)`` is a ``BlockIterator`` with ``state_dict``/``load_state_dict``, so
StatefulDataLoader saves each worker's cursor instead of counting batches, and a resume
re-reads the window the cursor is in instead of replaying the batches before it.
"""

from __future__ import annotations

import io
import json
import logging
import time

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset

from helpers.fault_proxy import FaultProxy
from helpers.pipeline import assert_batches_equal, dataset, make_corpus, random_docs, write_stream
from streamforge import PackedTokenDataset, ResumeMismatchError, Stream
from streamforge.pipeline.blocks import BlockIterator
from streamforge.pipeline.batch import expand
from streamforge.pipeline.dataset import WorkerPipeline
from streamforge.storage.config import StorageConfig
from streamforge.resume.state import content_digest

stateful = pytest.importorskip(
    "torchdata.stateful_dataloader",
    reason="torchdata is not installed (it is in the test extra: pip install -c constraints.txt -e '.[test]')",
)
StatefulDataLoader = stateful.StatefulDataLoader

# torchdata 0.11 calls a torch function that newer torch deprecates; not ours to act on
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

NAIVE = "naively fast-forwarding"
WORKERS = [pytest.param(0, id="w0"), pytest.param(2, id="w2")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("sdl"), np.random.default_rng(7))


@pytest.fixture
def torchdata_log(caplog):
    """Everything torchdata logs from this process (its fast-forward warning is logged
    here, in the process that loads the state, with any number of workers)."""
    caplog.set_level(logging.WARNING, logger="torchdata")
    return caplog


def _loader(ds, num_workers, **kwargs):
    return StatefulDataLoader(ds, batch_size=4, num_workers=num_workers, **kwargs)


def _clone(batch):
    return {k: v.clone() for k, v in batch.items()}


def _run(loader, n=None):
    out = []
    for batch in loader:
        out.append(_clone(batch))
        if n is not None and len(out) >= n:
            break
    return out


def _checkpoint(state):
    """``state`` through torch.save/torch.load (weights_only), as a trainer checkpoints it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def _iterator_states(state):
    """Our iterators' states inside a StatefulDataLoader state (one per worker)."""
    if "_snapshot" in state:
        workers = state["_snapshot"]["_worker_snapshots"].values()
        return [w["fetcher_state"]["dataset_iter_state"] for w in workers]
    return [state["fetcher_state"]["dataset_iter_state"]]


def _cut(make_loader, cut):
    """The first ``cut`` batches of a fresh loader and its state after them."""
    loader = make_loader()
    head = _run(loader, cut)
    state = _checkpoint(loader.state_dict())
    del loader  # stops its workers
    return head, state


# -- exact resume -----------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", WORKERS)
def test_resume_early_and_late_matches_the_uninterrupted_run(corpus, num_workers, torchdata_log):
    def make():
        return _loader(dataset(corpus, weights=[0.5, 0.3, 0.2]), num_workers)

    reference = _run(make())
    assert len(reference) > 100
    for cut in (3, len(reference) - 7):
        head, state = _cut(make, cut)
        assert_batches_equal(head, reference[:cut])
        for sub in _iterator_states(state):
            assert sub["num_workers"] == max(num_workers, 1) and sub["pipeline"] is not None
            json.dumps(sub)  # plain data
        resumed = make()
        resumed.load_state_dict(state)
        assert_batches_equal(_run(resumed), reference[cut:])
    assert NAIVE not in torchdata_log.text


def test_the_warning_check_sees_a_naive_fast_forward(torchdata_log):
    """The check above is not vacuous: a dataset without the protocol is fast-forwarded."""

    class Plain(IterableDataset):
        def __iter__(self):
            return ({"x": x} for x in torch.arange(40))

    loader = StatefulDataLoader(Plain(), batch_size=4)
    _run(loader, 3)
    resumed = StatefulDataLoader(Plain(), batch_size=4)
    resumed.load_state_dict(loader.state_dict())
    assert torch.equal(next(iter(resumed))["x"], torch.arange(12, 16))
    assert NAIVE in torchdata_log.text


@pytest.mark.parametrize("num_workers", WORKERS)
def test_infinite_resume_across_a_pass_boundary(corpus, num_workers, torchdata_log):
    def make():
        return _loader(dataset(corpus, weights=[0.5, 0.3, 0.2], infinite=True), num_workers)

    total = 320  # "web" starts its second pass near batch 200, in either worker count
    reference = _run(make(), total)
    for cut, past_boundary in ((150, False), (280, True)):
        head, state = _cut(make, cut)
        passes = [
            s["reader"]["pass"]
            for sub in _iterator_states(state)
            for s in WorkerPipeline.stream_states(sub["pipeline"])
        ]
        # resumed before the boundary, the tail crosses it; after it, the cursor is in pass 1
        assert (max(passes) >= 1) == past_boundary, passes
        resumed = make()
        resumed.load_state_dict(state)
        assert_batches_equal(_run(resumed, total - cut), reference[cut:])
    assert NAIVE not in torchdata_log.text


# -- what a resume fetches --------------------------------------------------------------------
@pytest.fixture
def counted_s3(tmp_path, s3_server, s3_bucket):
    """One stream in a loopback S3 bucket, read through a pass-through proxy that counts the
    bytes it serves (worker processes included); yields (make_dataset, proxy)."""
    import s3fs

    bucket, opts = s3_bucket
    url = str(tmp_path / "web")
    write_stream(url, random_docs(np.random.default_rng(2), 1500, 100), shard_size="64KiB", frame_size="4KiB")
    s3fs.S3FileSystem(**opts).put(url, f"{bucket}/web", recursive=True)
    proxy = FaultProxy(s3_server.endpoint_url, rate=0.0).start()
    through = s3_server.storage_options(proxy.endpoint_url)
    no_prefetch = StorageConfig(prefetch_bytes=0)  # count only what the cursors ask for

    def make_dataset():
        stream = Stream(f"s3://{bucket}/web", name="web", storage_options=through)
        return PackedTokenDataset(stream, seq_len=64, shuffle_buffer=64, storage=no_prefetch)

    yield make_dataset, proxy
    proxy.stop()


def _quiet(proxy, idle_s=0.5):
    """The bytes served once no request came for ``idle_s`` (workers have built every batch
    asked of them, prefetched ones included, and wait)."""
    last = (-1, -1)
    while (proxy.requests, proxy.bytes_served) != last:
        last = (proxy.requests, proxy.bytes_served)
        time.sleep(idle_s)
    return proxy.bytes_served


@pytest.mark.parametrize("num_workers", WORKERS)
def test_a_late_resume_fetches_no_more_than_an_early_one(counted_s3, num_workers, torchdata_log):
    make_dataset, proxy = counted_s3
    after = 5  # batches taken after each resume
    early, late = 2, 400  # of ~1000 batches in the pass

    def make():
        return _loader(make_dataset(), num_workers)

    reference = _run(make(), late + after)
    before = _quiet(proxy)
    _run(make(), late)
    replay_cost = _quiet(proxy) - before  # what reading up to the late cut costs
    fetched = {}
    for cut in (early, late):
        _, state = _cut(make, cut)
        resumed = make()  # the manifest is read here, before counting starts
        resumed.load_state_dict(state)
        start = _quiet(proxy)
        tail = _run(resumed, after)
        fetched[cut] = _quiet(proxy) - start
        del resumed
        assert_batches_equal(tail, reference[cut:cut + after])
    assert fetched[late] <= fetched[early], fetched
    # a replay would have fetched at least the late cut's bytes again
    assert fetched[late] < replay_cost / 4, (fetched, replay_cost)
    assert NAIVE not in torchdata_log.text


# -- refusals ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_worker_state(corpus):
    _, state = _cut(lambda: _loader(dataset(corpus), 2), 9)
    return state


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers, 2 cores
@pytest.mark.parametrize("num_workers", [1, 3])
def test_a_state_from_another_worker_count_is_refused(corpus, two_worker_state, num_workers):
    loader = _loader(dataset(corpus), num_workers)
    loader.load_state_dict(two_worker_state)
    with pytest.raises(ResumeMismatchError, match=rf"num_workers: saved 2, now {num_workers}"):
        next(iter(loader))


def test_iterator_refuses_another_workers_or_configs_state(corpus):
    it = BlockIterator(dataset(corpus), worker=1, num_workers=2)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))
    with pytest.raises(ResumeMismatchError, match=r"worker: saved 1, now 0"):
        BlockIterator(dataset(corpus), worker=0, num_workers=2).load_state_dict(state)
    with pytest.raises(ResumeMismatchError, match=r"num_workers: saved 2, now 1.*worker: saved 1, now 0"):
        iter(dataset(corpus)).load_state_dict(state)
    with pytest.raises(ResumeMismatchError, match=r"seed: saved 0, now 3"):
        BlockIterator(dataset(corpus, seed=3), worker=1, num_workers=2).load_state_dict(state)
    with pytest.raises(ResumeMismatchError, match=r"version 7"):
        BlockIterator(dataset(corpus), worker=1, num_workers=2).load_state_dict(dict(state, version=7))
    broken = json.loads(json.dumps(state))
    WorkerPipeline.stream_states(broken["pipeline"])[0]["reader"]["offset"] = 10**6
    with pytest.raises(ResumeMismatchError, match=r"digest does not match its content"):
        BlockIterator(dataset(corpus), worker=1, num_workers=2).load_state_dict(broken)
    broken.pop("digest")  # behind a matching digest, the cursor checks name the stage and value
    broken["digest"] = content_digest(broken)
    with pytest.raises(ResumeMismatchError, match=r"ShardReader\(web\): offset 1000000"):
        BlockIterator(dataset(corpus), worker=1, num_workers=2).load_state_dict(broken)


# -- direct iteration -------------------------------------------------------------------------
def test_direct_iteration_is_the_pipelines_blocks_and_resumes_through_json(corpus):
    ds = dataset(corpus, weights=[0.5, 0.3, 0.2], provenance=True)
    pipeline = ds.make_pipeline(0, 1)
    want = []
    while (rows := pipeline.next_batch(1)) is not None:
        block = expand(rows, boundary=ds.config.boundary, provenance=True)
        want.append({k: v[0] for k, v in block.items()})
    pipeline.close()
    got = [_clone(b) for b in ds]
    assert_batches_equal(got, want)

    it = iter(ds)
    fresh = it.state_dict()
    assert fresh["pipeline"] is None and fresh["worker"] == 0 and fresh["num_workers"] == 1
    for _ in range(37):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))
    it.close()
    resumed = iter(dataset(corpus, weights=[0.5, 0.3, 0.2], provenance=True))
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert_batches_equal([_clone(b) for b in resumed], want[37:])
    assert resumed.state_dict()["done"]
    finished = iter(ds)
    finished.load_state_dict(resumed.state_dict())
    assert list(finished) == []
