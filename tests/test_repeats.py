"""Upsampling in a finite pass: ``Stream(repeat=k)`` and ``upsample=True``, readings across
every kind of resume and in the ledger, and the warning when the weights cannot be honoured.

The corpus is the one of issue #40: two streams weighted 0.5 / 0.5, one 20x smaller."""

from __future__ import annotations

import collections
import hashlib
import json
import warnings

import numpy as np
import pytest

from helpers.pipeline import assert_batches_equal, delivered_spans, make_corpus
from streamforge import (
    ConfigError, EvaluationDataset, MixtureWarning, PackedTokenDataset, ResumeMismatchError, Stream, StreamingLoader,
    merge_states, unpack_state,
)
from streamforge.cli import main
from streamforge.ledger.report import check, show
from streamforge.ledger.store import read_ledger
from streamforge.ledger.text import format_check


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("repeats"), np.random.default_rng(3),
                       spec=(("big", 600, 60), ("small", 30, 60)))


def _dataset(corpus, small=None, *, rank=None, world_size=None, **kwargs):
    streams = [Stream(corpus["big"][0], 0.5, "big"), Stream(corpus["small"][0], 0.5, "small", **(small or {}))]
    kwargs.setdefault("seq_len", 64)
    kwargs.setdefault("shuffle_buffer", 16)
    return PackedTokenDataset(streams, provenance=True, rank=rank, world_size=world_size, **kwargs)


def _loader(corpus, small=None, workers=0, batch=2, **kwargs):
    return StreamingLoader(_dataset(corpus, small, **kwargs), batch_size=batch, num_workers=workers)


def _pieces(batch):
    seg = batch["segments"].reshape(-1, 5)
    return seg[seg[:, 0] >= 0].numpy()


def _run(ldr, until=None):
    """(step, batch) pairs to the end of the pass or to step ``until``."""
    out = []
    if until is not None and ldr.step >= until:
        return out
    for batch in ldr:
        out.append((ldr.step - 1, {k: v.clone() for k, v in batch.items()}))
        if until is not None and ldr.step >= until:
            break
    return out


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixtureWarning)
        return fn(*args, **kwargs)


def _longest(corpus):
    return max(len(d) + 1 for _, docs in corpus.values() for d in docs)


def _small_tokens(corpus):
    return sum(len(d) + 1 for d in corpus["small"][1] if len(d))


def _coverage(pieces):
    """(stream, shard, record) -> delivered token intervals; asserts none overlaps."""
    return delivered_spans(row for block in pieces for row in block.tolist())


# -- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("small,kwargs,match", [
    (dict(repeat=0), {}, r"stream 'small': repeat must be a number > 0"),
    (dict(repeat=-1.5), {}, r"stream 'small': repeat must be"),
    (dict(repeat=float("nan")), {}, r"stream 'small': repeat must be"),
    (dict(repeat=float("inf")), {}, r"stream 'small': repeat must be"),
    (dict(repeat="2"), {}, r"stream 'small': repeat must be"),
    (dict(repeat=True), {}, r"stream 'small': repeat must be"),
    (dict(repeat=1e6), {}, r"stream 'small': repeat must be .*<= 10000"),
    (dict(upsample="yes"), {}, r"stream 'small': upsample must be True or False"),
    (dict(repeat=2, upsample=True), {}, r"stream 'small': give repeat= or upsample=True, not both"),
    (dict(upsample=True), dict(infinite=True), r"stream 'small': upsample=True fills a finite pass"),
    (dict(upsample=True), dict(anneal=(10, {"small": 1.0})), r"from step 10 .*\['small'\] hold all the weight"),
])
def test_repeat_and_upsample_are_checked(corpus, small, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _dataset(corpus, small, **kwargs)


def test_an_evaluation_dataset_reads_once(corpus):
    with pytest.raises(ConfigError, match="stream 'small': an evaluation dataset reads every held-out token once"):
        EvaluationDataset([Stream(corpus["small"][0], name="small", repeat=2)], seq_len=64)


def test_upsample_computes_the_readings_the_weights_need(corpus):
    big = sum(len(d) + 1 for d in corpus["big"][1] if len(d))
    ds = _dataset(corpus, dict(upsample=True))
    assert ds.repeats[0] == 1.0 and ds.repeats[1] == pytest.approx(big / _small_tokens(corpus), rel=1e-5)
    assert ds.describe()["streams"][1]["repeat"] == ds.repeats[1] and ds.describe()["streams"][1]["upsample"]
    assert "repeat" not in ds.describe()["streams"][0]  # a stream read once describes itself as before
    # with phases, the steps matter: books-like anneal to the big stream halves the need
    annealed = _dataset(corpus, dict(upsample=True), anneal=(200, {"big": 1.0}))
    StreamingLoader(annealed, batch_size=2)  # the loader binds its batch: 128 tokens a step
    assert annealed.repeats[1] == pytest.approx(200 * 128 * 0.5 / _small_tokens(corpus), rel=1e-3)
    assert repr(Stream("u", repeat=2.5)).endswith("repeat=2.5)")


# -- the warning ----------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_that_runs_out_is_warned_before_the_first_batch(corpus, workers):
    ldr = _loader(corpus, workers=workers)
    it = iter(ldr)
    with pytest.warns(MixtureWarning, match=r"stream 'small' runs out at step (\d+),.*expected token shares over "
                                            r"the pass: big 0\.9\d+, small 0\.0\d+ \(the weights ask for big 0\.500"):
        next(it)
    estimate = ldr.stats()["mixture"]
    assert not estimate["honoured"] and list(estimate["runs_out"]) == ["small"]
    assert 0 < estimate["runs_out"]["small"] < 0.2 * ldr.steps_per_pass
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixtureWarning)  # once per pass
        for _ in it:
            pass
    stats = ldr.stats()
    total = sum(s["tokens"] for s in stats["streams"].values())
    realized = stats["streams"]["small"]["tokens"] / total
    assert realized == pytest.approx(estimate["expected_shares"]["small"], abs=0.01)
    # the tokens of the small stream are all delivered, long before the pass ends
    assert stats["streams"]["small"]["tokens"] == _small_tokens(corpus)


# -- upsampling honours the weights ---------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["upsample", "repeat"])
def test_upsampling_gives_the_weights_over_the_pass(corpus, workers, how):
    big = sum(len(d) + 1 for d in corpus["big"][1] if len(d))
    small = dict(upsample=True) if how == "upsample" else dict(repeat=round(big / _small_tokens(corpus), 3))
    ldr = _loader(corpus, small, workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixtureWarning)
        assert ldr.stats()["mixture"]["honoured"] and ldr.stats()["mixture"]["runs_out"] == {}
        steps = ldr.steps_per_pass
        batches = _run(ldr)
    assert len(batches) == steps
    stats = ldr.stats()
    tokens = {k: v["tokens"] for k, v in stats["streams"].items()}
    total = sum(tokens.values())
    assert total == len(batches) * 2 * 64
    # the deficit schedule's bound, per worker: within about two documents of the share
    assert abs(tokens["small"] - total / 2) <= 2 * max(workers, 1) * _longest(corpus), tokens
    assert tokens["small"] > 15 * _small_tokens(corpus)  # without it: one reading, 0.06 of the pass


@pytest.mark.parametrize("workers", [0, 2])
def test_each_reading_delivers_every_record_once_in_its_own_order(corpus, workers):
    ldr = _loader(corpus, dict(repeat=2.5), workers=workers)
    num_shards = ldr.dataset.manifests[1].num_shards
    pieces = [_pieces(b) for _, b in _quiet(_run, ldr)]  # 2.5 readings do not fill half the pass: it warns
    seen = _coverage(pieces)
    readings = collections.defaultdict(dict)
    for (stream, shard, record), spans in seen.items():
        if stream == 1:
            readings[shard // num_shards][shard % num_shards, record] = sum(b - a for a, b in spans)
    want = {}
    for shard, docs in enumerate(_records_per_shard(ldr.dataset)):
        for record, length in enumerate(docs):
            if length:
                want[shard, record] = length + 1
    assert sorted(readings) == [0, 1, 2]
    assert readings[0] == want and readings[1] == want  # whole readings: every record once
    part = sum(readings[2].values()) / sum(want.values())
    assert 0.4 < part < 0.6 and set(readings[2]) < set(want)  # the first half of the third reading's order

    def order(r):
        return [(s % num_shards, rec) for block in pieces for st, s, rec, t, _ in block.tolist()
                if st == 1 and s // num_shards == r and t == 0]
    assert order(0) != order(1) and sorted(order(0)) == sorted(order(1))


def _records_per_shard(ds):
    from streamforge.source import ShardSource

    source = ShardSource.open(ds.streams[1].url)
    return [source.index(k).records["num_tokens"].tolist() for k in range(source.manifest.num_shards)]


# -- resume ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_an_exact_resume_in_the_middle_of_a_reading(corpus, workers):
    ref = _run(_loader(corpus, dict(upsample=True), workers=workers))
    num_shards = _dataset(corpus).manifests[1].num_shards
    # the step at which reading 3 of the small stream has begun on some worker, and one deep inside it
    third = next(s for s, b in ref if any(p[0] == 1 and p[1] // num_shards == 3 for p in _pieces(b).tolist()))
    for cut in (third + 1, third + 7):
        first = _loader(corpus, dict(upsample=True), workers=workers)
        _run(first, cut)
        state = json.loads(json.dumps(first.state_dict()))
        resumed = _loader(corpus, dict(upsample=True), workers=workers)
        resumed.load_state_dict(state, strict=True)
        tail = _run(resumed, cut + 40)
        assert [s for s, _ in tail] == list(range(cut, cut + 40))
        assert_batches_equal([b for _, b in tail], [b for _, b in ref[cut:cut + 40]])


def _ranks(corpus, world, workers, batch, small):
    return [_loader(corpus, small, workers=workers, batch=batch, rank=r, world_size=world) for r in range(world)]


def _run_all(loaders, until=None):
    out = []
    for ldr in loaders:
        out += [_pieces(b) for _, b in _run(ldr, until)]
    return out


@pytest.mark.parametrize("small", [dict(upsample=True), dict(repeat=3.5)])
def test_an_elastic_resume_across_a_reading_boundary_delivers_each_reading_once(corpus, small):
    num_shards = _dataset(corpus).manifests[1].num_shards
    ref = _quiet(_run, _loader(corpus, small, workers=2, batch=2))
    boundary = next(s for s, b in ref if any(p[0] == 1 and p[1] // num_shards == 1 for p in _pieces(b).tolist()))
    first = _ranks(corpus, 1, 2, 2, small)
    bound = first[0].plan().drop_bound()
    total = sum(first[0].plan().tokens)
    before = _quiet(_run_all, first, boundary + 1)  # one worker into reading 1, the other still in reading 0
    assert any(p[0] == 1 and p[1] // num_shards == 0 for p in before[-1].tolist() + before[-2].tolist())
    state = json.loads(json.dumps(merge_states([ld.state_dict() for ld in first])))
    resumed = _ranks(corpus, 2, 1, 3, small)
    for ld in resumed:
        ld.load_state_dict(state)
        assert ld.resume_report.mode == "elastic" and ld.step == boundary + 1
    bound += resumed[0].plan().drop_bound()
    after = _quiet(_run_all, resumed)
    seen = _coverage(before + after)  # once per (stream, reading and shard, record)
    delivered = sum(b - a for spans in seen.values() for a, b in spans)
    assert 0 <= total - delivered <= bound
    readings = {shard // num_shards for stream, shard, _ in seen if stream == 1}
    assert readings == set(range(int(np.ceil(first[0].dataset.repeats[1]))))


def test_a_statistical_resume_of_a_repeated_stream_runs(corpus):
    first = _loader(corpus, dict(repeat=3.5), workers=2)
    _quiet(_run, first, 40)
    state = first.state_dict()
    resumed = _loader(corpus, dict(repeat=3.5), workers=2, seed=1)  # another seed: statistical
    resumed.load_state_dict(state)
    assert resumed.resume_report.mode == "statistical" and resumed.step == 40
    assert len(_quiet(_run, resumed, 60)) == 20
    again = _loader(corpus, dict(repeat=3.5), workers=2)
    again.resume_from_counters({"big": 20_000, "small": 9_000})
    assert len(_quiet(_run, again, again.step + 5)) == 5
    fewer = _loader(corpus, dict(repeat=2), workers=2)  # fewer readings than the saved cursors went through
    fewer.load_state_dict(state)
    assert fewer.resume_report.mode == "statistical"
    assert "stream 'small': repeat 3.5 -> 2.0" in fewer.resume_report.differences
    assert len(_quiet(_run, fewer, 60)) == 20


def test_saved_work_outside_the_readings_is_refused(corpus):
    first = _ranks(corpus, 1, 2, 2, dict(repeat=2))
    _quiet(_run_all, first, 30)
    resumed = _loader(corpus, dict(repeat=2), workers=1, batch=2)
    resumed.load_state_dict(first[0].state_dict())
    assert resumed.resume_report.mode == "elastic"
    _quiet(_run, resumed, 35)
    saved = resumed.state_dict()
    inner = unpack_state(saved)
    ranges = inner["remaining"]["work"]["streams"][1]["ranges"]
    assert ranges, "the saved work lists ranges of the small stream"
    num_shards = _dataset(corpus).manifests[1].num_shards
    ranges[0][0] = 2 * num_shards + 1  # shard 1 of a third reading, in a stream read twice
    text = json.dumps(inner)
    tampered = dict(saved, state=text, digest=hashlib.sha256(text.encode()).hexdigest())
    again = _loader(corpus, dict(repeat=2), workers=1, batch=2)
    with pytest.raises(ResumeMismatchError, match=r"stream 'small': .*reading 2 of shard 1, outside its 2 reading"):
        again.load_state_dict(tampered, strict=True)
    again.load_state_dict(saved, strict=True)  # the loader is as it was: the true state loads
    assert again.resume_report.mode == "exact"


# -- the ledger -------------------------------------------------------------------------------------
def test_the_ledger_checks_an_upsampled_pass_and_finds_a_duplicate_within_a_reading(corpus, tmp_path, capsys):
    url = tmp_path / "ledger"
    ds = _dataset(corpus, dict(repeat=3))
    ldr = StreamingLoader(ds, batch_size=2, num_workers=2, ledger_dir=str(url))
    _quiet(_run, ldr)
    ledger = read_ledger(str(url))
    report = check(ledger, dict(zip(ds.stream_names, ds.manifests)))
    assert report["ok"], report["problems"]
    (p,) = report["passes"]
    assert p["records_never_reached"]["small"]["whole_readings"] == 3
    assert p["records_never_reached"]["small"]["never_reached"] == 0
    assert "whole_readings" not in p["records_never_reached"]["big"]  # read once (its tail may be dropped)
    assert main(["ledger", "check", str(url)]) == 0
    capsys.readouterr()
    n = ds.manifests[1].num_shards
    at = int(np.flatnonzero((ledger.pieces["stream"] == 1) & (ledger.pieces["shard"] // n == 2))[0])
    shown = [p for rank in show(ledger, int(ledger.pieces["step"][at]))["ranks"] for p in rank["rows"]]
    assert {"reading": 2, "shard": int(ledger.pieces["shard"][at]) - 2 * n} in [
        {k: p.get(k) for k in ("reading", "shard")} for p in shown if p["stream"] == "small"]
    assert all("reading" not in p for p in shown if p["stream"] == "big")
    # clean although each record of the small stream came three times: once per reading
    firsts = (ledger.pieces["stream"] == 1) & (ledger.pieces["token_start"] == 0)
    physical = ledger.pieces["shard"][firsts] % n * 10**6 + ledger.pieces["record"][firsts]
    assert set(np.unique(physical, return_counts=True)[1].tolist()) == {3}
    # a record of reading 1 delivered a second time in reading 1: a duplicate
    pieces = ledger.pieces
    small = np.flatnonzero((pieces["stream"] == 1) & (pieces["shard"] // n == 1) & (pieces["token_start"] == 0))
    i, j = int(small[0]), int(small[-1])
    for key in ("shard", "record", "token_start", "length"):
        pieces[key][j] = pieces[key][i]
    report = check(ledger)
    assert not report["ok"] and len(report["duplicates"]) == 1
    dup = report["duplicates"][0]
    assert (dup["stream"], dup["reading"], dup["shard"]) == ("small", 1, int(pieces["shard"][i]) % n)
    assert f"small reading 1 shard {dup['shard']} record {dup['record']}" in format_check(report, str(url))


def test_a_pass_of_no_step_is_not_also_a_mixture_warning(corpus):
    ldr = _loader(corpus, batch=10_000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(ldr) == []
    assert [w.category for w in caught] == [UserWarning] and "has 0 steps" in str(caught[0].message)
    assert ldr.stats()["mixture"]["honoured"]


def test_each_reading_has_its_own_shard_order_and_cuts():
    from streamforge.planning.plan import plan_stream
    from streamforge.planning.readings import plan_readings

    records = np.full(40, 10)
    tokens = np.arange(40) * 7 + 100
    args = dict(seed=3, stream_key="small", pass_idx=0)
    # one reading is the stream's own plan, untouched
    assert plan_readings(records, tokens, repeat=1.0, num_global_workers=3, **args) == plan_stream(
        records, tokens, num_global_workers=3, **args)
    (whole,) = plan_readings(records, tokens, repeat=2.5, num_global_workers=1, **args)
    by_reading = collections.defaultdict(list)
    for shard, a, b in whole:
        by_reading[shard // 40].append((shard % 40, a, b))
    assert sorted(by_reading) == [0, 1, 2]
    first, second = ([s for s, _, _ in by_reading[r]] for r in (0, 1))
    assert sorted(first) == sorted(second) == list(range(40)) and first != second  # own order, every shard
    part = sum(tokens[s] * (b - a) / 10 for s, a, b in by_reading[2]) / tokens.sum()
    assert abs(part - 0.5) < 0.02  # the first half of the third reading's order, in tokens
    assert [s for s, _, _ in by_reading[2]][:5] != first[:5]
    # with workers, every reading is cut among them once, and a worker's pieces rotate
    per_worker = plan_readings(records, tokens, repeat=2.0, num_global_workers=4, **args)
    for r in (0, 1):
        got = sorted((s % 40, a, b) for ranges in per_worker for s, a, b in ranges if s // 40 == r)
        assert sum(b - a for _, a, b in got) == 400
    alone = plan_stream(records, tokens, num_global_workers=4, seed=3, stream_key="small#reading1", pass_idx=0)
    assert [(s - 40, a, b) for s, a, b in per_worker[0] if s >= 40] == alone[1]


# -- with a batch-size ramp: the steps hold different tokens ---------------------------------------
def test_upsample_counts_the_tokens_of_a_ramp(corpus):
    """The readings ``upsample=True`` computes follow the tokens the steps hold: with a ramp
    (2 rows to step 100, then 4) the anneal at step 200 comes after 100 * 128 + 100 * 256
    tokens, not 200 * 128."""
    annealed = _dataset(corpus, dict(upsample=True), anneal=(200, {"big": 1.0}))
    StreamingLoader(annealed, batch_size=[(0, 2), (100, 4)])
    assert annealed.repeats[1] == pytest.approx((100 * 128 + 100 * 256) * 0.5 / _small_tokens(corpus), rel=1e-3)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_warning_under_a_ramp_names_the_step_the_stream_runs_out(corpus, workers):
    """The estimate spends each batch's own tokens: the step it names for the small stream
    is the step at which the loader hands out its last token of it."""
    ldr = StreamingLoader(_dataset(corpus), batch_size=[(0, 1), (6, 3)], num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixtureWarning)
        estimate = ldr.stats()["mixture"]
        last = None
        for batch in ldr:
            if (_pieces(batch)[:, 0] == 1).any():
                last = ldr.step - 1
    assert not estimate["honoured"]
    assert abs(estimate["runs_out"]["small"] - last) <= 2 * max(workers, 1), (estimate, last)
    stats = ldr.stats()
    total = sum(s["tokens"] for s in stats["streams"].values())
    assert stats["streams"]["small"]["tokens"] / total == pytest.approx(estimate["expected_shares"]["small"], abs=0.01)


# -- the warning's threshold -------------------------------------------------------------------------
def test_a_stream_running_out_just_before_the_tail_is_not_warned_when_the_shares_hold():
    """Two workers, weights 0.5/0.5: a stream short by a few tokens runs out a few steps
    before the pass's tail, yet every share stays within SHARE_TOLERANCE: no warning, the
    step still listed. Short by a tenth, it is warned."""
    from streamforge.planning.shortfall import estimate

    def run(short: float):
        held = [[10_000, int(10_000 * (1 - short))]] * 2
        return estimate(["a", "b"], held, starts=[0], weights=[[0.5, 0.5]], steps=200, first_step=0,
                        workers_per_rank=1, tokens_per_batch=100.0)

    near = run(0.03)
    assert "b" in near["runs_out"] and near["runs_out"]["b"] < 196 and near["honoured"], near
    far = run(0.1)
    assert not far["honoured"] and far["expected_shares"]["a"] > 0.51, far
