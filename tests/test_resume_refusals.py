"""States that must not load: without this rank's part, corrupted cursors, old versions;
strict mode; joining ranks' states with merge_states."""

import copy
import hashlib
import json

import numpy as np
import pytest

from helpers.pipeline import assert_batches_equal, dataset, loader, make_corpus, take
from streamforge import ResumeMismatchError, merge_states, unpack_state


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("refuse"), np.random.default_rng(13))


def _loader(corpus, rank=0, world_size=2, num_workers=2, **kwargs):
    return loader(dataset(corpus, rank=rank, world_size=world_size, **kwargs), num_workers=num_workers)


@pytest.fixture(scope="module")
def saved(corpus):
    ldr = _loader(corpus, rank=1, num_workers=0)
    take(ldr, 9)
    return json.loads(json.dumps(ldr.state_dict()))


def test_a_state_without_this_ranks_part_is_refused_naming_both(corpus, saved):
    with pytest.raises(ResumeMismatchError, match=r"rank\(s\) \[1\] of 2, not of rank 0.*merge_states"):
        _loader(corpus, rank=0, num_workers=0).load_state_dict(saved)


def test_merge_states_joins_the_ranks_and_each_resumes_exactly(corpus, saved):
    ranks = []
    for rank in range(2):
        ldr = _loader(corpus, rank=rank, num_workers=0)
        take(ldr, 9)
        ranks.append(ldr)
    merged = merge_states([r.state_dict() for r in ranks])
    assert [p["rank"] for p in unpack_state(merged)["ranks"]] == [0, 1]
    for rank, first in enumerate(ranks):
        resumed = _loader(corpus, rank=rank, num_workers=0)
        resumed.load_state_dict(json.loads(json.dumps(merged)), strict=True)
        assert_batches_equal(take(resumed, 5), take(first, 5))
    behind = _loader(corpus, rank=0, num_workers=0)
    take(behind, 8)
    with pytest.raises(ResumeMismatchError, match="state 1 has step 8, state 0 9"):
        merge_states([saved, behind.state_dict()])


def _worker(state, w=0):
    return state["ranks"][1]["workers"][w]


def _buffer(state, stream=0):
    return _worker(state)["packer"]["source"]["sources"][stream]


def _redigested(saved, inner):
    """``inner`` packed with a digest that matches it: what a hand-built state looks like, so
    that the value checks behind the digest (the second line) are what refuses it."""
    text = json.dumps(inner)
    outer = {k: inner[k] for k in ("step", "pass", "world_size") if k in inner}
    return dict(saved, **outer, state=text, digest=hashlib.sha256(text.encode()).hexdigest())


@pytest.mark.parametrize("corrupt,match", [
    (lambda s: _buffer(s)["reader"].update(offset=10**6), r"ShardReader\(web\): offset 1000000"),
    (lambda s: _buffer(s)["reader"].update(range=99), r"ShardReader\(web\): range 99"),
    (lambda s: _buffer(s).update(pos=10**5, loaded=True), r"ShuffleBuffer\(web\): pos 100000"),
    (lambda s: _buffer(s).update(token_offset=10**6, loaded=True), r"ShuffleBuffer\(web\): token_offset 1000000"),
    (lambda s: _buffer(s).update(window=-3), r"ShuffleBuffer\(web\): window -3"),
    (lambda s: _worker(s)["packer"]["source"].update(phase=7), r"Interleaver: phase 7"),
    (lambda s: _worker(s)["packer"]["source"].update(current=5), r"Interleaver: current stream 5"),
    (lambda s: _worker(s).update(batches=10**6), r"WorkerPipeline: worker 0 has built 1000000"),
    (lambda s: s.update(batch=10**6, step=s["pass_first_step"] + 10**6), r"batch 1000000 is outside pass 0"),
    (lambda s: s.update(batch=s["batch"] + 1), r"step 9 is not pass_first_step 0 \+ batch 10"),
    (lambda s: s.update(generation=None), r"generation is None, expected an integer >= 0"),
    (lambda s: s.update(skip_steps=[[1]]), r"skip_steps must be \[\[start, end\], ...\]"),
    (lambda s: s["ranks"][1].update(pass_tokens="7"), r"ranks\[1\].pass_tokens is '7'"),
    (lambda s: s["ranks"][1].update(workers=[None, None]), r"ranks\[1\].workers must list 1 worker"),
    (lambda s: _worker(s)["packer"].pop("source"), r"Packer: state lacks \['source'\]"),
    (lambda s: s["ranks"][1].pop("workers"), r"ranks\[1\] lacks \['workers'\]"),
    (lambda s: s["ranks"].append(None), r"one part per rank of the saved job \(2\), got 3"),
    (lambda s: s.pop("step"), r"lacks \['step'\]"),
])
def test_corrupted_cursors_are_refused_naming_stage_and_value(corpus, saved, corrupt, match):
    state = copy.deepcopy(unpack_state(saved))
    corrupt(state)
    ldr = _loader(corpus, rank=1, num_workers=0)
    with pytest.raises(ResumeMismatchError, match="digest does not match"):  # the first line
        ldr.load_state_dict(dict(saved, state=json.dumps(state)))
    with pytest.raises(ResumeMismatchError, match=match):  # the second, behind a digest that matches
        ldr.load_state_dict(_redigested(saved, state))
    assert ldr.step == 0 and ldr.resume_report is None  # refused states leave the loader as it was
    assert_batches_equal(take(ldr, 2), take(_loader(corpus, rank=1, num_workers=0), 2))


def test_old_state_versions_get_a_clear_error(corpus, saved):
    with pytest.raises(ResumeMismatchError, match="version 1.*reads 4.*before the global step"):
        _loader(corpus, rank=1, num_workers=0).load_state_dict(dict(saved, version=1))
    with pytest.raises(ResumeMismatchError, match=r"version 2 lacks \['fingerprint'"):
        _loader(corpus, rank=1, num_workers=0).load_state_dict({"version": 2, "rank": 1, "workers": []})
    with pytest.raises(ResumeMismatchError, match="'state' field is not valid JSON"):
        _loader(corpus, rank=1, num_workers=0).load_state_dict(dict(saved, version=3, state="{oops"))


def test_a_version_2_state_resumes_statistically_from_its_rank(corpus, saved):
    inner = unpack_state(saved)
    part = inner["ranks"][1]
    old = {"version": 2, **{k: inner[k] for k in ("fingerprint", "config", "world_size", "workers_per_rank",
                                                  "step", "pass", "pass_first_step", "batch", "skip_steps")},
           "rank": 1, "workers": part["workers"], "pass_tokens": part["pass_tokens"],
           "counters": part["counters"], "skipped": part["skipped"], "remaining": None}
    ldr = _loader(corpus, rank=1, num_workers=0)
    ldr.load_state_dict(json.loads(json.dumps(old)))
    assert ldr.resume_report.mode == "statistical"
    assert "state version 2" in ldr.resume_report.differences[0]
    assert ldr.step == inner["step"] and len(take(ldr, 3)) == 3
    with pytest.raises(ResumeMismatchError, match="would not be exact"):
        _loader(corpus, rank=1, num_workers=0).load_state_dict(old, strict=True)


def test_strict_refuses_anything_but_exact(corpus, saved):
    other = _loader(corpus, rank=1, num_workers=2)
    with pytest.raises(ResumeMismatchError, match="would not be exact.*workers_per_rank"):
        other.load_state_dict(saved, strict=True)
    same = _loader(corpus, rank=1, num_workers=0)
    same.load_state_dict(saved, strict=True)
    assert same.resume_report.mode == "exact"


def test_more_ranks_than_saved_goes_statistical_and_says_why(corpus, saved):
    counts = []
    for rank in range(3):
        ldr = _loader(corpus, rank=rank, world_size=3, num_workers=0)
        ldr.load_state_dict(saved)
        report = ldr.resume_report
        assert report.mode == "statistical"
        assert any("world_size" in d for d in report.differences)
        assert ldr.step == saved["step"]
        counts.append(len(take(ldr)))
    assert len(set(counts)) == 1 and counts[0] > 0, counts  # ranks still agree on the steps left
