"""With worker processes, an iteration's first batch is built in the training process while
no worker runs yet (``StreamingLoader._head_start``); the workers start from the state after
it, and the batches, states and counters are those of a loader without it."""

import json

import pytest

import streamforge.loader.loader as loader_module
from helpers.pipeline import assert_batches_equal, dataset, loader, make_corpus, take
from streamforge.pipeline.batch import expand


def _by_hand(ds, num_workers: int, n: int) -> list:
    """The clock's definition: batch i of a pass from logical worker i % W's pipeline."""
    job = loader(ds, num_workers=num_workers).job([None] * num_workers)
    pipelines = [job.pipeline(w) for w in range(num_workers)]
    try:
        return [expand(pipelines[i % num_workers].next_batch(job.batch_size)) for i in range(n)]
    finally:
        for p in pipelines:
            p.close()


def test_the_first_batch_comes_before_any_worker_process_starts(tmp_path, rng, monkeypatch):
    ds = dataset(make_corpus(tmp_path, rng), seq_len=32)
    started = []
    real = loader_module.process_batches

    def spy(*args, **kwargs):
        started.append(True)
        yield from real(*args, **kwargs)

    monkeypatch.setattr(loader_module, "process_batches", spy)
    ld = loader(ds, num_workers=2)
    it = iter(ld)
    first = next(it)
    assert not started  # built here: the workers are started only for the next batch
    second = next(it)
    assert started
    del it
    assert_batches_equal([first, second], _by_hand(ds, 2, 2))


@pytest.mark.parametrize("at", [1, 2, 3, 7])
def test_resumes_with_workers_equal_those_without(tmp_path, rng, at):
    ds = dataset(make_corpus(tmp_path, rng), seq_len=32)
    reference = _by_hand(ds, 2, 30)
    assert_batches_equal(take(loader(ds, num_workers=2), 30), reference)
    first = loader(ds, num_workers=2)
    take(first, at)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader(ds, num_workers=2)
    resumed.load_state_dict(state)
    assert_batches_equal(take(resumed, 30 - at), reference[at:])
    # the counters hold the head start's reads as well as the workers'
    assert resumed.stats()["streams"]["web"]["frames_decoded"] > 0


def test_a_pass_with_workers_counts_what_it_handed_out(tmp_path, rng):
    ds = dataset(make_corpus(tmp_path, rng), seq_len=32)
    ld = loader(ds, num_workers=2)
    batches = take(ld)
    stats = ld.stats()
    for i, name in enumerate(("web", "code", "books")):
        handed = sum(int(((b["source_ids"] == i) & (b["doc_ids"] >= 0)).sum()) for b in batches)
        assert stats["streams"][name]["tokens"] == handed


def test_no_thread_of_the_head_start_is_alive_when_the_workers_start(tmp_path, rng, monkeypatch):
    """The head start of a resume fetches its frames on threads (``fetch_now``); the workers
    are forked after it, so none of them may still run."""
    import threading

    from streamforge.storage.config import StorageConfig

    ds = dataset(make_corpus(tmp_path, rng), seq_len=32, storage=StorageConfig(prefetch_bytes=1 << 20))
    alive, before = [], set()
    real = loader_module.process_batches

    def spy(*args, **kwargs):  # threads started since ``before`` (other tests' may linger)
        alive.append([t.name for t in threading.enumerate() if t not in before])
        yield from real(*args, **kwargs)

    monkeypatch.setattr(loader_module, "process_batches", spy)
    first = loader(ds, num_workers=2)
    before.update(threading.enumerate())
    take(first, 5)
    resumed = loader(ds, num_workers=2)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    before.update(threading.enumerate())
    take(resumed, 3)
    assert alive == [[], []], alive


def test_the_training_process_fetches_each_index_once_across_plan_checks_and_head_start(tmp_path, rng, monkeypatch):
    """The planner, the check of every saved worker state and the head start each open their
    own sources; they share the record indexes any of them read (``adopt_indexes``)."""
    from collections import Counter

    from streamforge.source.shard_source import ShardSource

    corpus = make_corpus(tmp_path, rng)
    first = loader(dataset(corpus, seq_len=32), num_workers=2)
    take(first, 7)
    state = json.loads(json.dumps(first.state_dict()))
    fetched = Counter()
    real = ShardSource._fetch_index

    def spy(self, shard):
        fetched[(self.fetcher.url, shard)] += 1
        return real(self, shard)

    monkeypatch.setattr(ShardSource, "_fetch_index", spy)
    resumed = loader(dataset(corpus, seq_len=32), num_workers=2)  # a new process's objects
    resumed.load_state_dict(state)
    it = iter(resumed)
    next(it)  # the head start, in this process
    del it
    assert fetched and max(fetched.values()) == 1, fetched
