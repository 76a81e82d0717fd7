"""Mixture phases with an LR scale, and the anneal shortcut: validation, ``loader.lr_scale``
and ``stats()`` around a switch, and after every kind of resume."""

import json

import numpy as np
import pytest

from helpers.pipeline import assert_batches_equal, loader, make_corpus
from streamforge import ConfigError, PackedTokenDataset, Phase, Stream

NAMES = ["web", "code", "books"]
SWITCH = 9
SCHEDULE = [(0, {"web": 0.7, "code": 0.3, "books": 0.0}), Phase(SWITCH, {"web": 0.2, "books": 0.8}, lr_scale=0.25)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("phases"), np.random.default_rng(5))


def _dataset(corpus, **kwargs):
    streams = [Stream(url, name=name) for name, (url, _) in corpus.items()]
    kwargs.setdefault("seq_len", 64)
    kwargs.setdefault("shuffle_buffer", 32)
    kwargs.setdefault("infinite", True)
    return PackedTokenDataset(streams, provenance=True, **kwargs)


def _build(corpus, num_workers=0, **kwargs):
    return loader(_dataset(corpus, **kwargs), num_workers=num_workers)


@pytest.mark.parametrize("kwargs,match", [
    (dict(weights=[(0, {"web": 1.0}), (10, {"code": 1.0}, 0.5), (10, {"books": 1.0})]), "phase 2 starts at step 10"),
    (dict(weights=[(0, {"web": 1.0}), (20, {"code": 1.0}), (10, {"books": 1.0})]), "phase 2 starts at step 10"),
    (dict(weights=[(0, {"web": 1.0}), (10, {"code": 1.0}, 0.0)]), r"phase 1 \(step 10\): lr_scale .*> 0, got 0"),
    (dict(weights=[(0, {"web": 1.0}), (10, {"code": 1.0}, -2)]), r"phase 1 \(step 10\): lr_scale"),
    (dict(weights=[(0, {"web": 1.0}, float("inf"))]), r"phase 0 \(step 0\): lr_scale .*finite"),
    (dict(weights=[(0, {"web": 1.0}, float("nan"))]), r"phase 0 \(step 0\): lr_scale"),
    (dict(weights=[(0, {"web": 1.0}, "0.5")]), r"phase 0 \(step 0\): lr_scale"),
    (dict(weights=[Phase(0, {"web": 1.0}), Phase(5, {"web": 1.0}, lr_scale=True)]), r"phase 1 \(step 5\): lr_scale"),
    (dict(weights=[(0, {"web": 1.0}, 1.0, "extra")]), "phase 0 must be"),
    (dict(weights=[(0, {"web": 1.0})], anneal=(50, {"books": 1.0})), "not both"),
    (dict(anneal=(-1, {"books": 1.0})), "anneal phase's step must be an integer >= 0, got -1"),
    (dict(anneal=(1.5, {"books": 1.0})), "anneal phase's step"),
    (dict(anneal=(50, {"novels": 1.0})), r"anneal phase \(step 50\) names unknown stream 'novels'"),
    (dict(anneal=(50, {})), r"anneal phase \(step 50\) needs a non-empty"),
    (dict(anneal=(50, {"books": 1.0}, 0)), r"anneal phase \(step 50\): lr_scale"),
    (dict(anneal=(50, {"books": -1.0})), r"phase 1 \(step 50\), stream 'books': weight"),
    (dict(anneal=(50, {"books": 0.0})), r"phase 1 \(step 50\) gives every stream weight 0"),
    (dict(anneal={"books": 1.0}), "anneal must be"),
    (dict(anneal=50), "anneal must be"),
    (dict(weights="web"), "weights must be"),
])
def test_every_schedule_error_names_its_phase(corpus, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _dataset(corpus, **kwargs)


def test_phase_forms_agree_and_describe_their_lr_scale(corpus):
    a = _dataset(corpus, weights=[(0, {"web": 1.0}), (SWITCH, {"books": 2.0}, 0.5)]).schedule
    b = _dataset(corpus, weights=[Phase(0, {"web": 1.0}), Phase(SWITCH, {"books": 2.0}, lr_scale=0.5)]).schedule
    assert a == b and a.lr_scales == (1.0, 0.5)
    phases = a.describe()["phases"]
    assert "lr_scale" not in phases[0] and phases[1]["lr_scale"] == 0.5
    # a schedule without an LR scale describes itself as before: old fingerprints still hold
    plain = _dataset(corpus, weights=[(0, {"web": 1.0}), (SWITCH, {"books": 2.0})]).schedule
    assert all("lr_scale" not in p for p in plain.describe()["phases"]) and plain.lr_scales == ()
    assert [plain.lr_scale_at(s) for s in (0, SWITCH, 10**9)] == [1.0, 1.0, 1.0]
    # the LR scale is part of the loader config, so of the resume fingerprint
    assert _build(corpus, weights=SCHEDULE).fingerprint != _build(
        corpus, weights=[(0, SCHEDULE[0][1]), (SWITCH, SCHEDULE[1].weights)]).fingerprint


def test_anneal_shortcut_compiles_to_two_phases(corpus):
    ds = _dataset(corpus, weights={"web": 3.0, "code": 1.0}, anneal=(40, {"books": 3.0, "code": 1.0}, 0.1))
    s = ds.schedule
    assert s.starts == (0, 40)
    # phase 0: the weights mapping, books at its base weight (1.0)
    assert s.weights_at(39) == pytest.approx((3 / 5, 1 / 5, 1 / 5))
    assert s.weights_at(40) == pytest.approx((0.0, 0.25, 0.75))  # web not listed: 0
    assert (s.lr_scale_at(39), s.lr_scale_at(40), s.lr_scale_at(10**6)) == (1.0, 0.1, 0.1)
    at_zero = _dataset(corpus, anneal=(0, {"books": 1.0})).schedule
    assert at_zero.starts == (0,) and at_zero.weights_at(0) == (0.0, 0.0, 1.0)


def test_anneal_switches_the_batches_at_its_step(corpus):
    ldr = _build(corpus, 0, anneal=(6, {"books": 1.0}, 0.5))
    scales = []
    for batch in ldr:
        step = ldr.step - 1
        streams = batch["segments"].reshape(-1, 5)
        streams = streams[streams[:, 0] >= 0]
        if step > 6:  # step 6 may finish the document in progress at the switch
            assert set(streams[:, 0].tolist()) == {2}, step
        scales.append(ldr.lr_scale)
        if ldr.step == 12:
            break
    assert scales == [1.0] * 5 + [0.5] * 7  # the scale of the step about to be trained
    stats = ldr.stats()
    assert stats["lr_scale"] == 0.5 and [p["lr_scale"] for p in stats["phases"]] == [1.0, 0.5]


def _scales_through(ldr, last):
    """(step about to be trained, lr_scale, stats lr_scale) before each step up to ``last``."""
    out = [(ldr.step, ldr.lr_scale, ldr.stats()["lr_scale"])]
    for _ in ldr:
        out.append((ldr.step, ldr.lr_scale, ldr.stats()["lr_scale"]))
        if ldr.step > last:
            break
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_lr_scale_follows_the_clock_around_the_switch(corpus, num_workers):
    seen = _scales_through(_build(corpus, num_workers, weights=SCHEDULE), SWITCH + 3)
    for step, scale, reported in seen:
        assert scale == reported == (0.25 if step >= SWITCH else 1.0), step
    assert [s for s, _, _ in seen] == list(range(SWITCH + 5))


def _stop_at(ldr, step):
    got = []
    if step == 0:
        return got
    for batch in ldr:
        got.append({k: v.clone() for k, v in batch.items()})
        if ldr.step >= step:
            break
    return got


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("cut", [SWITCH - 1, SWITCH, SWITCH + 1])
def test_lr_scale_is_right_before_the_first_step_after_an_exact_resume(corpus, num_workers, cut):
    ref = _build(corpus, num_workers, weights=SCHEDULE)
    want = _stop_at(ref, SWITCH + 4)
    first = _build(corpus, num_workers, weights=SCHEDULE)
    _stop_at(first, cut)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = _build(corpus, num_workers, weights=SCHEDULE)
    resumed.load_state_dict(state, strict=True)
    assert resumed.step == cut
    assert resumed.lr_scale == resumed.stats()["lr_scale"] == (0.25 if cut >= SWITCH else 1.0)
    assert resumed.stats()["phase"] == (1 if cut >= SWITCH else 0)
    tail = _stop_at(resumed, SWITCH + 4)
    assert_batches_equal(tail, want[cut:])
    assert resumed.lr_scale == 0.25


@pytest.mark.parametrize("mode", ["elastic", "statistical"])
def test_lr_scale_is_right_after_elastic_and_statistical_resumes(corpus, mode):
    first = _build(corpus, 2, weights=SCHEDULE, infinite=False)
    _stop_at(first, SWITCH)
    state = first.state_dict()
    if mode == "elastic":  # other workers and batch size
        resumed = loader(_dataset(corpus, weights=SCHEDULE, infinite=False), num_workers=1, batch_size=4)
        resumed.load_state_dict(state)
    else:
        resumed = _build(corpus, 2, weights=SCHEDULE, infinite=False)
        resumed.load_state_dict(state, mode="statistical")
    assert resumed.resume_report.mode == mode
    assert resumed.step == SWITCH and resumed.lr_scale == 0.25 and resumed.stats()["lr_scale"] == 0.25
    before = _build(corpus, 2, weights=SCHEDULE, infinite=False)
    _stop_at(before, SWITCH - 1)
    again = _build(corpus, 0, weights=SCHEDULE, infinite=False)
    again.load_state_dict(before.state_dict())
    assert again.resume_report.mode == "elastic" and again.lr_scale == 1.0
    _stop_at(again, SWITCH)
    assert again.lr_scale == 0.25
