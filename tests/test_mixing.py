"""Mixture schedules keyed by the global step, temperature, skip ranges, counters."""

import json

import numpy as np
import pytest
import torch

from helpers.pipeline import assert_batches_equal, loader, make_corpus
from streamforge import ConfigError, PackedTokenDataset, Stream, StorageConfig, unpack_state

NAMES = ["web", "code", "books"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("mix"), np.random.default_rng(11))


def _dataset(corpus, **kwargs):
    streams = [Stream(url, name=name) for name, (url, _) in corpus.items()]
    kwargs.setdefault("seq_len", 64)
    kwargs.setdefault("shuffle_buffer", 32)
    return PackedTokenDataset(streams, provenance=True, **kwargs)


def _build(corpus, num_workers=0, weights=None, skip_steps=None, **kwargs):
    kwargs.setdefault("infinite", True)
    return loader(_dataset(corpus, weights=weights, **kwargs), num_workers=num_workers, skip_steps=skip_steps)


def _take_steps(ldr, n):
    """n batches and the global step of each."""
    out = []
    for batch in ldr:
        out.append((ldr.step - 1, {k: v.clone() for k, v in batch.items()}))
        if len(out) >= n:
            break
    return out


def _pieces(batch):
    segs = batch["segments"].reshape(-1, 5)
    return segs[segs[:, 0] >= 0]


@pytest.mark.parametrize("bad,match", [
    ([(5, {"web": 1.0})], "phase 0 must start at step 0"),
    ([(0, {"web": 1.0}), (10, {"code": 1.0}), (10, {"books": 1.0})], "phase 2 starts at step 10"),
    ([(0, {"web": 1.0}), (10, {"nope": 1.0})], "phase 1 .*unknown stream 'nope'"),
    ([(0, {"web": -1.0})], "phase 0 .*stream 'web'.*>= 0"),
    ([(0, {"web": 0.0, "code": 0.0, "books": 0.0})], "phase 0 .*weight 0"),
    ([(0, {"web": 1.0}), "oops"], "phase 1 must be"),
])
def test_malformed_schedules_are_named(corpus, bad, match):
    with pytest.raises(ConfigError, match=match):
        _dataset(corpus, weights=bad)


@pytest.mark.parametrize("temperature", [0, -1.0, float("nan")])
def test_temperature_must_be_positive(corpus, temperature):
    with pytest.raises(ConfigError, match="temperature"):
        _dataset(corpus, temperature=temperature)


def test_temperature_flattens(corpus):
    ds = _dataset(corpus, weights={"web": 0.8, "code": 0.2, "books": 0.0}, temperature=2.0)
    web, code, books = ds.schedule.weights_at(0)
    assert web == pytest.approx(2 / 3) and code == pytest.approx(1 / 3) and books == 0.0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_phase_switch_takes_effect_exactly_at_its_step(corpus, num_workers):
    switch = 13
    schedule = [(0, {"web": 1.0, "code": 0.0, "books": 0.0}), (switch, {"web": 0.0, "code": 1.0, "books": 0.0})]
    got = _take_steps(_build(corpus, num_workers, weights=schedule), switch + 10)
    W = max(num_workers, 1)
    carried, code_after = set(), 0
    for step, batch in got:
        streams = _pieces(batch)[:, 0]
        if step < switch:
            assert (streams == 0).all(), f"step {step}: a stream other than web before the switch"
        else:
            pieces = _pieces(batch)
            web = pieces[pieces[:, 0] == 0]
            # only the rest of the web document already in progress in this worker's carry
            assert len({tuple(x) for x in web[:, 1:3].tolist()}) <= 1, f"step {step}: two web documents"
            assert (web[:, 3] > 0).all(), f"step {step}: a new web document after the switch"
            carried.update((step % W, tuple(x)) for x in web[:, 1:3].tolist())
            code_after += int((streams == 1).sum())
    assert len(carried) <= W  # at most one document carried over per worker
    assert code_after > 0


def test_realized_shares_per_phase_follow_the_weights(corpus):
    schedule = [(0, {"web": 0.7, "code": 0.3, "books": 0.0}), (100, {"web": 0.2, "code": 0.2, "books": 0.6})]
    workers = 2
    ldr = _build(corpus, workers, weights=schedule)
    _take_steps(ldr, 200)
    stats = ldr.stats()
    assert stats["step"] == 200 and stats["phase"] == 1
    # the deficit schedule's bound, per worker: a stream is off its share by at most about
    # one of the longest documents (counted when picked, emitted over several batches)
    longest = max(len(d) + 1 for _, docs in corpus.values() for d in docs)
    for phase in stats["phases"]:
        total = sum(phase["tokens"].values())
        for name in NAMES:
            off = abs(phase["tokens"][name] - phase["weights"][name] * total)
            assert off <= 2 * workers * longest, (phase, name)
            assert phase["shares"][name] == pytest.approx(phase["weights"][name], abs=0.12), (phase, name)
    total = sum(s["tokens"] for s in stats["streams"].values())
    assert total == 200 * 2 * 64  # concat: every token of every batch counted once
    assert all(s["documents"] > 0 for s in stats["streams"].values())


def test_an_upweighted_stream_does_not_monopolize_the_new_phase(corpus):
    switch = 30
    schedule = [(0, {"web": 1.0, "code": 0.01, "books": 0.0}), (switch, {"web": 0.5, "code": 0.5, "books": 0.0})]
    got = _take_steps(_build(corpus, 0, weights=schedule), switch + 12)
    after = torch.cat([_pieces(b) for step, b in got if step >= switch + 1])
    code = int(after[after[:, 0] == 1, 4].sum())
    total = int(after[:, 4].sum())
    assert 0.3 < code / total < 0.7, f"code took {code / total:.0%} of the tokens right after the switch"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_phase_and_inside_a_skip_range_is_exact(corpus, num_workers):
    schedule = [(0, {"web": 0.7, "code": 0.3}), (20, {"web": 0.1, "books": 0.9})]
    skips = [(24, 29)]
    ref = _take_steps(_build(corpus, num_workers, weights=schedule, skip_steps=skips), 40)
    assert not any(24 <= s < 29 for s, _ in ref)
    ref_stats = None
    for cut_step in (22, 26):  # inside phase 1; inside the skip range
        first = _build(corpus, num_workers, weights=schedule, skip_steps=skips)
        head = []
        for batch in first:
            head.append(batch)
            if first.step >= cut_step:
                break
        state = json.loads(json.dumps(first.state_dict()))
        assert unpack_state(state)["skip_steps"] == [[24, 29]]
        resumed = _build(corpus, num_workers, weights=schedule)  # skips come back from the state
        resumed.load_state_dict(state, strict=True)
        tail = _take_steps(resumed, 40 - len(head))
        assert [s for s, _ in tail] == [s for s, _ in ref[len(head):]]
        assert_batches_equal([b for _, b in tail], [b for _, b in ref[len(head):]])
        stats = resumed.stats()
        if ref_stats is None:
            full = _build(corpus, num_workers, weights=schedule, skip_steps=skips)
            _take_steps(full, 40)
            ref_stats = full.stats()
        for key in ("step", "phase", "streams", "phases", "skipped_steps", "skipped_tokens"):
            assert _counters(stats[key]) == _counters(ref_stats[key]), key


def _counters(value):
    """The mixture counters of a stats entry, without storage counters (bytes, retries)."""
    if isinstance(value, dict):
        return {k: _counters(v) for k, v in value.items() if k in ("tokens", "documents") or not isinstance(v, (int, float))
                or k in NAMES}
    return value


def test_skip_given_at_resume_time_removes_exactly_those_steps(corpus):
    ref = _take_steps(_build(corpus, 2), 30)
    first = _build(corpus, 2)
    _take_steps(first, 10)
    state = first.state_dict()
    resumed = _build(corpus, 2, skip_steps=[(14, 19)])
    resumed.load_state_dict(state)
    assert resumed.resume_report.mode == "exact"
    tail = _take_steps(resumed, 15)
    want = [(s, b) for s, b in ref[10:] if not 14 <= s < 19]
    assert [s for s, _ in tail] == [s for s, _ in want]
    assert_batches_equal([b for _, b in tail], [b for _, b in want])
    assert resumed.stats()["skipped_steps"] == 5 and resumed.stats()["skip_steps"] == [[14, 19]]


def test_a_mixtures_streams_share_one_read_ahead_budget(corpus):
    """The read-ahead budget and threads are a pipeline's: each stream gets its largest
    weight's share (at least 1 MiB; threads rounded up), and a single stream gets all of it."""
    storage = StorageConfig(prefetch_bytes=16 << 20, prefetch_threads=4)
    weights = [(0, {"web": 0.1, "code": 0.3, "books": 0.6}), (5, {"web": 0.1, "code": 0.9, "books": 0.0})]
    ds = _dataset(corpus, weights=weights, storage=storage)
    assert ds.read_shares == pytest.approx([0.1 / 1.6, 0.9 / 1.6, 0.6 / 1.6])
    pipeline = ds.make_pipeline(0, 1)
    try:
        for _ in range(3):
            pipeline.next_batch(2)
        budgets = [s._readahead.budget() for s in pipeline.sources]
        assert budgets == [(1 << 20, 1), (9 << 20, 3), (6 << 20, 2)]
        # the prefetchers run with those budgets
        assert [s._readahead.prefetcher.budget for s in pipeline.sources] == [b for b, _ in budgets]
    finally:
        pipeline.close()
    one = PackedTokenDataset(Stream(corpus["web"][0], name="web"), seq_len=64, storage=storage)
    assert one.read_shares == [1.0] and one.open_source(0)._readahead.budget() == (16 << 20, 4)
    # a budget below the floor is not raised to it; off stays off
    assert StorageConfig(prefetch_bytes=1 << 19).stream_read_ahead(True, 0.01) == (1 << 19, 1)
    assert StorageConfig(prefetch_bytes=0).stream_read_ahead(True, 0.5)[0] == 0
