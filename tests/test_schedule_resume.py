"""Resuming inside batch-size and sequence-length schedules: exact at every step around a
switch (0 and 2 DataLoader workers, every packing mode), elastic on another topology inside a
ramp with every token once, and statistical without a crash; ``loader.batch_size`` right after
a resume is the value of the first step to be trained."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.pipeline import assert_batches_equal, dataset, make_corpus, take
from streamforge import StreamingLoader, unpack_state
from test_elastic import _coverage, _run, _save, _total

BATCHES = [(0, 2), (6, 3), (12, 4)]
SEQ_LENS = [(0, 24), (9, 40)]
CUTS = range(4, 15)  # every step around the switches at 6, 9 and 12
AFTER = 5  # batches compared after each cut


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("sched-resume"), np.random.default_rng(41),
                       spec=(("web", 60, 60), ("code", 30, 150)))


def _loader(corpus, num_workers, packing):
    ds = dataset(corpus, weights=[0.6, 0.4], seq_len=SEQ_LENS, packing=packing, provenance=True, bestfit_window=6)
    return StreamingLoader(ds, batch_size=BATCHES, num_workers=num_workers)


@pytest.mark.parametrize("num_workers,packing", [
    (0, "concat"), (2, "concat"), (0, "bestfit"), (2, "bestfit"), (2, "pad"),
])
def test_exact_resume_at_every_step_around_the_switches(corpus, num_workers, packing):
    reference = take(_loader(corpus, num_workers, packing), CUTS[-1] + AFTER)
    for cut in CUTS:
        first = _loader(corpus, num_workers, packing)
        head = take(first, cut)
        state = json.loads(json.dumps(first.state_dict()))
        assert_batches_equal(head, reference[:cut])
        resumed = _loader(corpus, num_workers, packing)
        resumed.load_state_dict(state, strict=True)
        assert resumed.resume_report.mode == "exact"
        want = reference[cut]["input_ids"].shape
        assert resumed.step == cut and (resumed.batch_size, resumed.seq_len) == tuple(want), f"cut {cut}"
        assert_batches_equal(take(resumed, AFTER), reference[cut : cut + AFTER])


def test_an_exact_resume_finishes_the_pass_as_the_uninterrupted_run(corpus):
    reference = take(_loader(corpus, 2, "bestfit"))
    first = _loader(corpus, 2, "bestfit")
    take(first, 9)
    resumed = _loader(corpus, 2, "bestfit")
    resumed.load_state_dict(first.state_dict(), strict=True)
    assert_batches_equal(take(resumed), reference[9:])
    assert resumed.step == len(reference)


def _ranks(corpus, world, workers, batches, seq_lens=SEQ_LENS):
    return [StreamingLoader(dataset(corpus, [0.6, 0.4], rank=r, world_size=world, provenance=True, seq_len=seq_lens),
                            batch_size=batches, num_workers=workers) for r in range(world)]


def _shapes_follow(loaders, start):
    """Every rank's batches from ``start`` have their step's shape; the ranks end together."""
    for ld in loaders:
        it, step = iter(ld), start
        for batch in it:
            assert tuple(batch["input_ids"].shape) == (ld.batch_sizes.at(step), ld.dataset.seq_lens.at(step))
            step += 1
    assert len({ld.step for ld in loaders}) == 1


@pytest.mark.parametrize("first,then", [
    ((2, 2, BATCHES), (1, 0, BATCHES)),
    ((2, 2, BATCHES), (3, 1, BATCHES)),
    ((1, 2, BATCHES), (2, 2, [(0, 1), (10, 2), (16, 3)])),  # another ramp per rank, too
])
def test_elastic_resume_inside_a_ramp_delivers_every_token_once(corpus, first, then):
    loaders = _ranks(corpus, *first)
    bound = loaders[0].plan().drop_bound()
    cut = 10  # past the batch-size switch at 6 and the seq_len switch at 9, before the one at 12
    before = _run(loaders, cut)
    state = _save(loaders)
    resumed = _ranks(corpus, *then)
    for ld in resumed:
        ld.load_state_dict(state)
        assert ld.resume_report.mode == "elastic", str(ld.resume_report)
        assert ld.step == cut and ld.batch_size == dict(then[2]).get(cut, ld.batch_sizes.at(cut)) and ld.seq_len == 40
    assert len({ld.steps_per_pass for ld in resumed}) == 1
    left = resumed[0].steps_per_pass
    bound += resumed[0].plan().drop_bound()
    after = _run(resumed)
    assert all(ld.step == cut + left for ld in resumed)
    assert all(ld.stats()["padded_rows"] == 0 for ld in resumed)  # every new worker filled its steps
    delivered = _coverage(corpus, before + after)  # raises on a token delivered twice
    assert 0 <= _total(corpus) - delivered <= bound  # token conservation, within the drop bounds


def test_elastic_batches_have_their_steps_shape_and_resume_exactly(corpus):
    a = _ranks(corpus, 2, 1, BATCHES)
    _run(a, 7)
    b = _ranks(corpus, 1, 2, BATCHES)
    b[0].load_state_dict(_save(a))
    _run(b, 11)
    state = _save(b)
    assert "work" in unpack_state(state)["remaining"]
    c = _ranks(corpus, 1, 2, BATCHES)
    c[0].load_state_dict(state, strict=True)
    assert c[0].resume_report.mode == "exact" and c[0].batch_size == 3 and c[0].seq_len == 40
    _shapes_follow(c, 11)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_statistical_resume_inside_a_ramp_keeps_the_clock(corpus, num_workers):
    a = _ranks(corpus, 2, num_workers, BATCHES)
    _run(a, 8)
    state = _save(a)
    b = _ranks(corpus, 2, num_workers, BATCHES)
    for ld in b:
        ld.load_state_dict(state, mode="statistical")
        assert ld.resume_report.mode == "statistical" and ld.step == 8 and ld.batch_size == 3 and ld.seq_len == 24
    assert len({ld.steps_per_pass for ld in b}) == 1
    _shapes_follow(b, 8)


def test_a_state_resumed_under_other_schedules_resumes_statistically(corpus):
    a = _ranks(corpus, 2, 2, BATCHES)
    _run(a, 10)
    state = _save(a)
    b = _ranks(corpus, 2, 2, [(0, 1), (12, 2)], seq_lens=[(0, 16), (11, 32)])
    for ld in b:
        ld.load_state_dict(state)
        assert ld.resume_report.mode == "statistical" and "seq_len changed" in str(ld.resume_report)
        assert (ld.step, ld.batch_size, ld.seq_len) == (10, 1, 16)
    assert len({ld.steps_per_pass for ld in b}) == 1
    _shapes_follow(b, 10)
    assert all(ld.stats()["padded_rows"] == 0 for ld in b)


def test_resume_from_counters_estimates_the_step_through_the_ramp(corpus):
    ld = _ranks(corpus, 1, 0, BATCHES)[0]
    tokens = sum(ld.batch_sizes.at(s) * ld.dataset.seq_lens.at(s) for s in range(11))
    ld.resume_from_counters({"web": tokens * 0.6, "code": tokens * 0.4})
    assert ld.step == 11 and ld.batch_size == 3 and ld.seq_len == 40
    _shapes_follow([ld], 11)


def test_torchrun_two_ranks_with_a_batch_size_ramp_end_together(corpus, tmp_path):
    from pathlib import Path

    from helpers.torchrun import torchrun

    worker = Path(__file__).parent / "helpers" / "workers" / "ramp_worker.py"
    torchrun(worker, tmp_path, *[url for url, _ in corpus.values()])
    ranks = json.loads((tmp_path / "result.json").read_text())
    assert len(ranks) == 2
    assert ranks[0]["steps"] == ranks[1]["steps"] == ranks[0]["steps_per_pass"] == ranks[0]["step"] > 12
    for rank in ranks:
        assert [s["step"] for s in rank["full"]] == list(range(rank["steps"]))
        assert all(s["same"] and s["shape"] == s["scheduled"] for s in rank["full"])
        assert {tuple(s["shape"]) for s in rank["full"]} == {(2, 32), (3, 32), (3, 48), (5, 48)}
        assert rank["mode"] == "exact" and rank["resumed_first"] == [8, 3, 48]
        assert rank["resumed"] == rank["full"]  # the resumed run's steps are the uninterrupted run's


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_infinite_job_resumes_exactly_inside_its_ramp(corpus, num_workers):
    def build():
        ds = dataset(corpus, weights=[0.6, 0.4], seq_len=SEQ_LENS, infinite=True, packing="bestfit", bestfit_window=6)
        return StreamingLoader(ds, batch_size=BATCHES, num_workers=num_workers, skip_steps=[(10, 12)])

    reference = take(build(), 20)
    assert [tuple(b["input_ids"].shape) for b in reference[:12]] == [
        (2, 24)] * 6 + [(3, 24)] * 3 + [(3, 40)] + [(4, 40)] * 2  # steps 10 and 11 built and dropped
    for cut in (7, 9, 10):
        first = build()
        take(first, cut)
        resumed = build()
        resumed.load_state_dict(first.state_dict(), strict=True)
        assert_batches_equal(take(resumed, 20 - cut), reference[cut:])
