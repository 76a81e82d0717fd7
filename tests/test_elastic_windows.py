"""Elastic resume deals the saved shuffle windows' rests over the new workers: a rest is cut
into consecutive pieces in its emission order (and, with token cuts, inside documents), so a
re-plan drops no more than any plan does: what its lightest worker cannot fill."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.pipeline import dataset, delivered_spans, make_corpus, run_pieces
from streamforge import StreamingLoader, merge_states, unpack_state

SMALL = (("web", 60, 40), ("code", 20, 120))  # 80 documents


def _loaders(corpus, world, batch=2, **kwargs):
    kwargs.setdefault("seq_len", 32)
    kwargs.setdefault("shuffle_buffer", 8)
    return [StreamingLoader(dataset(corpus, [0.6, 0.4], rank=r, world_size=world, provenance=True, **kwargs),
                            batch_size=batch) for r in range(world)]


def _run(loaders, steps=None):
    """Every rank iterated to ``steps`` (default: the end of the pass); the pieces delivered."""
    return [tuple(row) for block in run_pieces(loaders, steps) for row in block.tolist()]


def _resumed(corpus, save, world, first=1, **kwargs):
    """A pass on ``first`` ranks saved at step ``save`` and finished elastically on ``world``
    ranks: (pieces delivered, the re-plan, the saved job's plan)."""
    first = _loaders(corpus, first, **kwargs)
    before = _run(first, save)
    state = json.loads(json.dumps(merge_states([ld.state_dict() for ld in first])))
    then = _loaders(corpus, world, **kwargs)
    for ld in then:
        ld.load_state_dict(state)
        assert ld.resume_report.mode == "elastic" and ld.step == save
    plan = then[0].plan()
    return before + _run(then), plan, first[0].plan()


def _again_then_elastic(corpus, loaders, step, **kwargs):
    """The two ranks of ``loaders``, at ``step`` of a pass they resumed elastically, saved:
    the state resumes exactly on two ranks (the same batches as ``loaders`` go on to give) and
    elastically on three. The pieces the three deliver to the pass's end, and their plan."""
    state = json.loads(json.dumps(merge_states([ld.state_dict() for ld in loaders])))
    want = _run(loaders)
    again = _loaders(corpus, 2, **kwargs)
    for ld in again:
        ld.load_state_dict(state, strict=True)
        assert ld.resume_report.mode == "exact"
    assert _run(again) == want
    third = _loaders(corpus, 3, **kwargs)
    for ld in third:
        ld.load_state_dict(state)
        assert ld.resume_report.mode == "elastic" and ld.step == step
    return _run(third), third[0].plan()


def _missing(corpus, pieces, packing, seq_len=32):
    """(tokens, documents) of the pass not delivered (pad packing keeps a row of each
    document); raises on a token delivered twice."""
    spans = delivered_spans(pieces)
    cap = seq_len if packing == "pad" else None
    total = sum(min(len(x) + 1, cap or len(x) + 1) for _, docs in corpus.values() for x in docs if len(x))
    docs = sum(1 for _, d in corpus.values() for x in d if len(x))
    return total - sum(b - a for s in spans.values() for a, b in s), docs - len(spans)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    # the falsifying history of test_membership: one rank until step 32, then two; the rest of
    # the pass is then one saved window's rest of 15 documents and one document
    return make_corpus(tmp_path_factory.mktemp("windows"), np.random.default_rng(48169), spec=SMALL)


@pytest.mark.parametrize("packing", ["pad", "concat"])
def test_a_window_rest_is_dealt_over_the_new_workers(corpus, packing):
    pieces, plan, _ = _resumed(corpus, 32, 2, packing=packing)
    # the rest's rows over both workers: the pass goes on (before: rows [15, 1], no step left
    # in pad packing, 16 documents and 497 tokens dropped; 1,885 tokens in concat)
    assert plan.steps > 0 and max(plan.rows) - min(plan.rows) <= len(SMALL) + 1
    tokens, docs = _missing(corpus, pieces, packing)
    if packing == "pad":  # what the lightest worker cannot fill: less than a batch of rows each
        assert docs <= plan.num_global_workers * (plan.batch_size - 1)
    else:  # less than one step's tokens per worker
        assert 0 <= tokens <= plan.num_global_workers * plan.batch_size * plan.seq_len
    assert tokens == plan.dropped_tokens() or packing == "pad"


@pytest.mark.parametrize("save,world", [(110, 2), (110, 3), (130, 2)])
def test_token_cuts_deal_a_window_rest_inside_its_documents(corpus, save, world):
    # the rest is mostly one saved window's rest: before, it went whole to one worker and the
    # re-plan kept one padded step (1,693 of its 1,757 tokens dropped at step 110)
    pieces, plan, saved = _resumed(corpus, save, world, cuts="tokens")
    tokens, _ = _missing(corpus, pieces, "concat")
    assert plan.steps > 1
    assert 0 <= tokens <= 2 * len(SMALL) * plan.num_global_workers + sum(saved.unassigned or ())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), save=st.floats(0.05, 0.95), first=st.integers(1, 2), world=st.integers(1, 2),
       mode=st.sampled_from(["concat", "pad", "tokens"]), buffer=st.sampled_from([4, 8, 16]))
def test_an_elastic_rest_drops_what_an_ordinary_plan_drops(tmp_path_factory, seed, save, first, world, mode, buffer):
    world += world >= first  # another topology
    corpus = make_corpus(tmp_path_factory.mktemp("prop"), np.random.default_rng(seed), spec=SMALL)
    packing = "pad" if mode == "pad" else "concat"
    kwargs = {"packing": packing, "shuffle_buffer": buffer, **({"cuts": "tokens"} if mode == "tokens" else {})}
    steps = _loaders(corpus, first, **kwargs)[0].steps_per_pass
    pieces, plan, saved = _resumed(corpus, max(1, int(save * steps)), world, first, **kwargs)
    tokens, docs = _missing(corpus, pieces, packing)
    n, rows = plan.num_global_workers, plan.rows
    if mode == "tokens":  # two tokens a stream and worker, and what the saved pass gave no worker
        assert 0 <= tokens <= 2 * len(SMALL) * n + sum(saved.unassigned or ())
        return
    # the ordinary bound: one batch per worker plus the spread of the workers' rows, which a
    # cut at the boundary nearest each quantile keeps within a document or record a stream
    if packing == "pad":
        assert max(rows) - min(rows) <= 2 * len(SMALL)
        assert 0 <= docs <= n * plan.batch_size + sum(r - min(rows) for r in rows)
    else:
        largest = sum(max(len(x) + 1 for x in d) for _, d in corpus.values())
        assert max(plan.tokens) - min(plan.tokens) <= 2 * largest
        assert 0 <= tokens <= plan.drop_bound() and tokens == plan.dropped_tokens()


def test_pieces_of_a_window_rest_resume_exactly_and_again_elastically(corpus):
    first = _loaders(corpus, 1, packing="pad")
    pieces = _run(first, 32)
    state = json.loads(json.dumps(merge_states([ld.state_dict() for ld in first])))
    second = _loaders(corpus, 2, packing="pad")
    for ld in second:
        ld.load_state_dict(state)
    windows = [u for stream in second[0].plan().windows for worker in stream for u in worker]
    assert any("stop" in u for u in windows)  # a rest split between the two workers
    pieces += _run(second, 34)  # inside the pieces
    more, plan = _again_then_elastic(corpus, second, 34, packing="pad")
    pieces += more
    _, docs = _missing(corpus, pieces, "pad")
    assert plan.steps > 0 and 0 <= docs <= plan.num_global_workers * plan.batch_size


def test_parts_of_documents_dealt_by_token_cuts_resume_again(corpus):
    kwargs = {"cuts": "tokens"}
    first = _loaders(corpus, 1, **kwargs)
    pieces = _run(first, 110)
    state = json.loads(json.dumps(merge_states([ld.state_dict() for ld in first])))
    second = _loaders(corpus, 2, **kwargs)
    for ld in second:
        ld.load_state_dict(state)
    windows = [u for stream in second[0].plan().windows for worker in stream for u in worker]
    assert any("trims" in u for u in windows)  # a document's parts on both workers
    pieces += _run(second, 115)
    more, plan = _again_then_elastic(corpus, second, 115, **kwargs)
    pieces += more
    tokens, _ = _missing(corpus, pieces, "concat")
    assert plan.steps > 0 and 0 <= tokens <= 2 * len(SMALL) * (2 + 3) + sum(first[0].plan().unassigned or ())


def test_a_re_plan_dealt_by_an_older_streamforge_resumes_statistically(corpus):
    """An older streamforge dealt saved windows whole: its re-plan, which the workers' cursors
    are read against, cannot be rebuilt here, so such a state resumes statistically and says
    why; strict=True refuses it; a state that says nothing of how it was dealt is not exact."""
    from streamforge import ResumeMismatchError
    from streamforge.resume.state import pack_state

    first = _loaders(corpus, 1)
    _run(first, 32)
    then = _loaders(corpus, 2)
    state = merge_states([ld.state_dict() for ld in first])
    for ld in then:
        ld.load_state_dict(state)
    _run(then, 34)
    saved = unpack_state(merge_states([ld.state_dict() for ld in then]))
    assert saved["remaining"]["work"]["deal"] == 2
    del saved["remaining"]["work"]["deal"]
    older = pack_state(saved)  # as the older streamforge saved it: digested, without 'deal'
    ld = _loaders(corpus, 2)[0]
    with pytest.raises(ResumeMismatchError, match="dealt saved shuffle windows whole"):
        ld.load_state_dict(older, strict=True)
    ld.load_state_dict(older)
    assert ld.resume_report.mode == "statistical" and ld.step == 34
    assert any("older streamforge" in d for d in ld.resume_report.differences)
    assert next(iter(ld))["input_ids"].shape == (2, 32)
