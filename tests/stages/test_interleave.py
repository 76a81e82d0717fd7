"""The token-share schedule: bounded deviation after any prefix, and runs == one-by-one."""

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline_helpers import dataset, loader, random_docs, take, write_stream


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
        stream, run = r
        got.append((stream, run.tokens.copy()))
    while (t := one_by_one.take(10**9)) is not None:
        want.append((t[0], t[1].copy()))
    assert sum(len(x) for _, x in got) == sum(len(x) for _, x in want)
    flat = lambda parts: np.concatenate([x for _, x in parts])  # noqa: E731
    assert np.array_equal(flat(got), flat(want))
    streams = lambda parts: np.concatenate([np.full(len(x), s) for s, x in parts])  # noqa: E731
    assert np.array_equal(streams(got), streams(want))
