"""States that must not load: another rank's, corrupted cursors, old versions; strict mode."""

import copy
import json

import numpy as np
import pytest

from pipeline_helpers import dataset, loader, make_corpus, take
from streamforge import ResumeMismatchError


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


def test_another_ranks_state_is_refused_naming_both(corpus, saved):
    with pytest.raises(ResumeMismatchError, match=r"rank 1 of 2.*loaded on rank 0"):
        _loader(corpus, rank=0, num_workers=0).load_state_dict(saved)


def _buffer(state, stream=0):
    return state["workers"][0]["packer"]["source"]["sources"][stream]


@pytest.mark.parametrize("corrupt,match", [
    (lambda s: _buffer(s)["reader"].update(offset=10**6), r"ShardReader\(web\): offset 1000000"),
    (lambda s: _buffer(s)["reader"].update(range=99), r"ShardReader\(web\): range 99"),
    (lambda s: _buffer(s).update(pos=10**5, loaded=True), r"ShuffleBuffer\(web\): pos 100000"),
    (lambda s: _buffer(s).update(token_offset=10**6, loaded=True), r"ShuffleBuffer\(web\): token_offset 1000000"),
    (lambda s: _buffer(s).update(window=-3), r"ShuffleBuffer\(web\): window -3"),
    (lambda s: s["workers"][0]["packer"]["source"].update(phase=7), r"Interleaver: phase 7"),
    (lambda s: s["workers"][0]["packer"]["source"].update(current=5), r"Interleaver: current stream 5"),
    (lambda s: s["workers"][0].update(batches=10**6), r"WorkerPipeline: worker 0 has built 1000000"),
    (lambda s: s.update(batch=10**6), r"batch 1000000 is outside pass 0"),
    (lambda s: s["workers"][0]["packer"].pop("source"), r"Packer: state lacks \['source'\]"),
])
def test_corrupted_cursors_are_refused_naming_stage_and_value(corpus, saved, corrupt, match):
    state = copy.deepcopy(saved)
    corrupt(state)
    with pytest.raises(ResumeMismatchError, match=match):
        _loader(corpus, rank=1, num_workers=0).load_state_dict(state)


def test_old_state_versions_get_a_clear_error(corpus, saved):
    state = dict(saved, version=1)
    with pytest.raises(ResumeMismatchError, match="version 1.*reads 2.*before the global step"):
        _loader(corpus, rank=1, num_workers=0).load_state_dict(state)


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
        if rank == 2:
            assert any("rank 2 was not in the saved job" in d for d in report.differences)
        assert ldr.step == saved["step"]
        counts.append(len(take(ldr)))
    assert len(set(counts)) == 1 and counts[0] > 0, counts  # ranks still agree on the steps left
