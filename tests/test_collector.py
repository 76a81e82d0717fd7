"""The cyclic garbage collector is paused while a pass is set up, and left as it was after."""

import gc

import numpy as np
import pytest

from helpers.pipeline import dataset, loader, make_corpus, take

from streamforge.loader import collector
from streamforge.pipeline.dataset import PackedTokenDataset, WorkerPipeline
from streamforge.format.manifest import Manifest
from streamforge.loader.loader import StreamingLoader


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("gc"), np.random.default_rng(0))


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def _spy(monkeypatch, owner, name, seen: list):
    """Record whether the collector runs each time ``owner.name`` is called."""
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        seen.append((name, gc.isenabled()))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)


def test_the_collector_is_paused_while_a_pass_is_set_up(corpus, monkeypatch, collector_on):
    seen = []
    _spy(monkeypatch, Manifest, "load", seen)
    _spy(monkeypatch, PackedTokenDataset, "pass_plan", seen)
    _spy(monkeypatch, WorkerPipeline, "next_batch", seen)
    batches = take(loader(dataset(corpus), num_workers=0), 3)
    assert len(batches) == 3
    assert gc.isenabled()
    loads = [on for name, on in seen if name == "load"]
    plans = [on for name, on in seen if name == "pass_plan"]
    builds = [on for name, on in seen if name == "next_batch"]
    assert loads and not any(loads), "manifests read with the collector on"
    assert plans and not any(plans), "the pass plan built with the collector on"
    assert builds[0] is False, "the first batch built with the collector on"
    assert all(builds[1:]), "the collector stayed off after the first batch"


def test_a_collector_the_trainer_turned_off_stays_off(corpus):
    was = gc.isenabled()
    gc.disable()
    try:
        take(loader(dataset(corpus), num_workers=0), 2)
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


def test_the_collector_is_back_on_when_the_set_up_fails(corpus, monkeypatch, collector_on):
    def fail(self, *args, **kwargs):
        raise RuntimeError("the first batch failed")

    monkeypatch.setattr(WorkerPipeline, "next_batch", fail)
    with pytest.raises(RuntimeError, match="the first batch failed"):
        take(loader(dataset(corpus), num_workers=0), 1)
    assert gc.isenabled()


def test_paused_nests(collector_on):
    with collector.paused():
        with collector.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_with_workers_the_head_start_runs_with_the_collector_on(corpus, monkeypatch, collector_on):
    """Worker processes are forked right after the head start: the collector is left as it is
    there (only the plan and the manifests are built with it paused)."""
    seen = []
    _spy(monkeypatch, StreamingLoader, "_head_start", seen)
    _spy(monkeypatch, PackedTokenDataset, "pass_plan", seen)
    take(loader(dataset(corpus), num_workers=1), 2)
    assert [on for name, on in seen if name == "_head_start"] == [True]
    assert not any(on for name, on in seen if name == "pass_plan")
