"""The token-share schedule: bounded deviation after any prefix, and runs == one-by-one."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.pipeline import dataset, loader, random_docs, take, write_stream
from streamforge import PackedTokenDataset, Stream


def _doc_sequence(batches):
    """(stream, length) of each document in emission order, from provenance segments."""
    seq = []
    for b in batches:
        segs = b["segments"].reshape(-1, 5)
        for stream, _, _, start, length in segs.tolist():
            if stream < 0:
                continue
            if start == 0:
                seq.append([stream, 0])
            seq[-1][1] += length
    return seq


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(weights=st.lists(st.floats(0.05, 5.0), min_size=2, max_size=4), medians=st.data(), seed=st.integers(0, 99))
def test_token_shares_stay_within_one_document(tmp_path_factory, weights, medians, seed):
    rng = np.random.default_rng(seed)
    tmp = tmp_path_factory.mktemp("mix")
    corpus = {}
    for i in range(len(weights)):
        median = medians.draw(st.sampled_from([5, 30, 200]))
        url = str(tmp / f"s{i}")
        corpus[f"s{i}"] = (url, write_stream(url, random_docs(rng, 40, median, min_len=1)))
    ds = dataset(corpus, weights=weights, seq_len=64, infinite=True, provenance=True, seed=seed)
    batches = take(loader(ds, batch_size=4), 60)
    seq = _doc_sequence(batches)
    w = np.asarray(weights) / sum(weights)
    max_len = {i: max(len(d) + 1 for d in corpus[f"s{i}"][1]) for i in range(len(weights))}
    emitted = np.zeros(len(weights))
    for stream, length in seq:
        emitted[stream] += length
        total = emitted.sum()
        over = emitted - w * total
        for i in range(len(weights)):
            # ahead by less than one of its own documents; behind by at most the others' lead
            assert over[i] <= max_len[i]
            assert -over[i] <= sum(max_len[j] for j in range(len(weights)) if j != i)


def test_runs_equal_one_document_at_a_time(tmp_path, rng):
    """The vectorized run path gives exactly the documents of the per-document schedule."""
    corpus = {}
    for i, median in enumerate([8, 40, 150]):
        url = str(tmp_path / f"s{i}")
        corpus[f"s{i}"] = (url, write_stream(url, random_docs(rng, 120, median, min_len=1)))
    ds = dataset(corpus, weights=[0.5, 0.3, 0.2], infinite=False)
    by_run = ds.make_pipeline(0, 1).interleaver
    one_by_one = ds.make_pipeline(0, 1).interleaver
    got, want = [], []
    while (r := by_run.take_run(97)) is not None:
        got.append(r)
    while (t := one_by_one.take(10**9)) is not None:
        want.append((t[0], t[1].copy(), *t[2:]))
    g, w = _pieces(got), _documents(want)
    assert np.array_equal(g[0], w[0]) and np.array_equal(g[1], w[1])
    assert g[2] == w[2]


def _join(rows, stream, shard, record, start, length):
    """Add a document piece, joined to the last one where it continues it."""
    if rows and rows[-1][:3] == [stream, shard, record] and rows[-1][3] + rows[-1][4] == start:
        rows[-1][4] += length
    else:
        rows.append([stream, shard, record, start, length])


def _pieces(runs):
    """Tokens, stream of each token, and one (stream, shard, record, token_start, length)
    row per document piece (pieces of a document that runs split are joined), of runs."""
    tokens, streams, rows = [], [], []
    for stream, run in runs:
        tokens.append(run.tokens.copy())
        # a run of stream -1 mixes streams and names each piece's
        per_piece = run.streams if stream < 0 else np.full(len(run.length), stream)
        streams.append(np.repeat(per_piece, run.length))
        for piece in zip(per_piece.tolist(), run.shard.tolist(), run.record.tolist(),
                         run.token_start.tolist(), run.length.tolist()):
            _join(rows, *piece)
    return _cat(tokens), _cat(streams), rows


def _documents(takes):
    """The same, of ``take`` results (one piece of one document each)."""
    rows = []
    for stream, tokens, shard, record, start, _ in takes:
        _join(rows, stream, shard, record, start, len(tokens))
    return (_cat([t[1] for t in takes]), _cat([np.full(len(t[1]), t[0]) for t in takes]), rows)


def _cat(arrays):
    return np.concatenate(arrays) if arrays else np.zeros(0, np.int64)


def _one_by_one(interleaver, n):
    """``take`` until ``n`` tokens: the schedule one document piece at a time."""
    out = []
    while (left := n - sum(len(t[1]) for t in out)) > 0 and (t := interleaver.take(left)) is not None:
        out.append((t[0], t[1].copy(), *t[2:]))
    return out


def _by_runs(interleaver, n):
    out = []
    while (left := n - sum(r.size for _, r in out)) > 0 and (r := interleaver.take_run(left)) is not None:
        out.append(r)
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_streams=st.integers(2, 5), data=st.data(), seed=st.integers(0, 999))
def test_scheduled_runs_equal_run_by_run(tmp_path_factory, num_streams, data, seed):
    """``take_run`` (one merge of the streams' ratios for a stretch of documents) gives the
    tokens, pieces and counters of ``take``, one document piece at a time, through window ends,
    phases that set weights to 0, streams running out, budgets cutting documents and peeks
    at the next token."""
    rng = np.random.default_rng(seed)
    tmp = tmp_path_factory.mktemp("sched")
    corpus = {}
    for i in range(num_streams):
        median = data.draw(st.sampled_from([3, 20, 90, 400]))
        url = str(tmp / f"s{i}")
        corpus[f"s{i}"] = (url, write_stream(url, random_docs(rng, data.draw(st.integers(5, 60)), median, min_len=1)))
    names = list(corpus)
    weight = st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.0, 3.0, 7.0])
    phases = []
    for start in sorted(set(data.draw(st.lists(st.integers(1, 40), max_size=3)))) if data.draw(st.booleans()) else []:
        row = {n: data.draw(weight) for n in names}
        if not any(row.values()):
            row[names[0]] = 1.0
        phases.append((start, row))
    first = {n: data.draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])) for n in names}
    ds = PackedTokenDataset([Stream(corpus[n][0], name=n) for n in names], weights=[(0, first)] + phases,
                            seq_len=64, infinite=data.draw(st.booleans()), shuffle_warmup=4,
                            shuffle_buffer=data.draw(st.sampled_from([4, 16, 64])), seed=seed)
    scheduled = ds.make_pipeline(0, 1).interleaver
    one_by_one = ds.make_pipeline(0, 1).interleaver
    budgets = data.draw(st.lists(st.integers(1, 700), min_size=1, max_size=40))
    peeks = data.draw(st.lists(st.booleans(), min_size=len(budgets), max_size=len(budgets)))
    for step, (n, peek) in enumerate(zip(budgets, peeks)):
        scheduled.set_step(step)
        one_by_one.set_step(step)
        if peek:  # as the packer does after a full batch: commits to the next document
            assert scheduled.peek_token() == one_by_one.peek_token()
        got, want = _by_runs(scheduled, n), _one_by_one(one_by_one, n)
        g, w = _pieces(got), _documents(want)
        assert np.array_equal(g[0], w[0]) and np.array_equal(g[1], w[1]), f"budget {step}: tokens differ"
        assert g[2] == w[2], f"budget {step}: pieces differ"
        assert scheduled.state_dict() == one_by_one.state_dict(), f"budget {step}: state differs"
        if not want:
            break


@pytest.mark.parametrize("weights", [
    [(0, {"a": 1.0, "b": 1.0})],
    [(0, {"a": 1.0, "b": 3.0}), (30, {"a": 5.0, "b": 1.0})],
])
def test_picks_planned_ahead_hold_over_many_small_budgets(tmp_path, rng, weights):
    """Short documents in large windows and budgets of a few tokens: each merge sees far
    more documents than a budget takes, and a new phase's weights take over at its step."""
    corpus = {}
    for name in ("a", "b"):
        url = str(tmp_path / name)
        corpus[name] = (url, write_stream(url, random_docs(rng, 300, 3, min_len=1)))
    ds = PackedTokenDataset([Stream(corpus[n][0], name=n) for n in corpus], weights=weights, seq_len=64,
                            shuffle_buffer=128, shuffle_warmup=128, infinite=True)
    scheduled = ds.make_pipeline(0, 1).interleaver
    one_by_one = ds.make_pipeline(0, 1).interleaver
    for step in range(300):
        scheduled.set_step(step)
        one_by_one.set_step(step)
        got, want = _by_runs(scheduled, 5), _one_by_one(one_by_one, 5)
        assert _pieces(got)[2] == _documents(want)[2], f"step {step}: pieces differ"
        assert scheduled.state_dict() == one_by_one.state_dict(), f"step {step}: state differs"
