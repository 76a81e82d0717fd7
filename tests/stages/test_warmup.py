"""Shuffle windows grow at the start of each pass (``shuffle_warmup``)."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.pipeline import assert_batches_equal, dataset, loader, random_docs, take, write_stream
from streamforge.storage.config import StorageConfig
from streamforge.errors import ConfigError
from streamforge.stages.shuffle import window_size


@given(st.integers(1, 10_000), st.integers(0, 20_000), st.integers(0, 70))
def test_window_sizes_double_up_to_the_buffer(size, warmup, window):
    got = window_size(size, warmup, window)
    assert 1 <= got <= size
    if warmup == 0:
        assert got == size
    else:
        assert got == min(size, warmup * 2**window)
        assert window_size(size, warmup, window + 1) >= got  # never shrinks within a pass
    assert window_size(size, warmup, -1 - window) == size  # a saved window's rest keeps its ranges


def _emission_order(ds, batches):
    """(shard, record) of each document, in the order the pipeline first emits it."""
    pipeline = ds.make_pipeline(0, 1)
    seen = {}
    for _ in range(batches):
        rows = pipeline.next_batch(2)
        if rows is None:
            break
        for key in zip(rows.shard.tolist(), rows.record.tolist()):
            seen.setdefault(key, len(seen))
    pipeline.close()
    return list(seen)


@pytest.mark.parametrize("warmup, sizes", [(4, [4, 8, 16, 32, 32, 32]), (0, [32] * 6), (64, [32] * 6)])
def test_each_window_holds_the_next_records_of_its_size(tmp_path, rng, warmup, sizes):
    url = str(tmp_path / "web")
    docs = write_stream(url, random_docs(rng, 200, 30, min_len=1))
    ds = dataset({"web": (url, docs)}, seq_len=32, shuffle_buffer=32, shuffle_warmup=warmup)
    records = [(s, r) for s, a, b in ds.planner.worker_ranges(0, 0, 1, 0) for r in range(a, b)]
    order = _emission_order(ds, 10_000)
    assert sorted(order) == sorted(records)  # every record once
    start = 0
    for size in sizes:
        # window k is a permutation of the next window_size(k) records of the worker's ranges
        assert set(order[start : start + size]) == set(records[start : start + size])
        start += size


def test_first_batch_reads_a_small_window(tmp_path, rng):
    url = str(tmp_path / "web")
    write_stream(url, random_docs(rng, 3000, 100, min_len=1), shard_size="64KiB", frame_size="4KiB")
    no_prefetch = StorageConfig(prefetch_bytes=0)  # count only what the windows ask for
    fetched = {}
    for warmup in (0, 16):
        ld = loader(dataset({"web": (url, None)}, shuffle_buffer=1024, shuffle_warmup=warmup, storage=no_prefetch))
        take(ld, 1)
        fetched[warmup] = ld.stats()["streams"]["web"]["bytes_fetched"]
    assert fetched[16] * 8 < fetched[0], fetched


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_inside_the_warmup_windows_is_exact(tmp_path, rng, workers):
    url = str(tmp_path / "web")
    write_stream(url, random_docs(rng, 400, 40, min_len=1))
    corpus = {"web": (url, None)}
    build = lambda: loader(dataset(corpus, seq_len=32, shuffle_buffer=64, shuffle_warmup=2), num_workers=workers)
    reference = take(build(), 60)
    for at in (1, 3, 7, 20):  # in the windows of 2, 4, 8... documents, and past them
        first = build()
        take(first, at)
        resumed = build()
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert resumed.resume_report.mode == "exact", str(resumed.resume_report)
        assert_batches_equal(take(resumed, 60 - at), reference[at:])


def test_a_state_saved_without_warmup_names_it(tmp_path, rng):
    """States saved before the warm-up existed had full windows: their config has no
    ``shuffle_warmup``, which means 0. Such a state resumes exactly with ``shuffle_warmup=0``;
    with a warm-up the report names the field."""
    url = str(tmp_path / "web")
    write_stream(url, random_docs(rng, 200, 40, min_len=1))
    corpus = {"web": (url, None)}
    first = loader(dataset(corpus, shuffle_warmup=0))
    take(first, 5)
    state = first.state_dict()
    assert "shuffle_warmup" not in json.loads(state["state"])["config"]
    same = loader(dataset(corpus, shuffle_warmup=0))
    same.load_state_dict(state)
    assert same.resume_report.mode == "exact"
    warm = loader(dataset(corpus, shuffle_warmup=4))
    warm.load_state_dict(state)
    assert warm.resume_report.mode != "exact"
    assert "shuffle_warmup: saved 0, now 4" in warm.resume_report.differences
    with pytest.raises(ConfigError, match="shuffle_warmup"):
        dataset(corpus, shuffle_warmup=-1)
