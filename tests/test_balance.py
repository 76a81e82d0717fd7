"""Balanced packing (packing="balance"): rows of equal attention cost, every token once per
pass on any topology and worker count, exact resume at every batch boundary, mixture shares
kept; and the per-step cost in stats() equal to the cost from each batch's doc_ids."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.pipeline import (assert_batches_equal, dataset, delivered_tokens, loader, make_corpus, random_docs, take,
                              write_stream)
from streamforge import AttentionCost, ConfigError, EvaluationDataset, Stream, StreamingLoader
from streamforge.ledger.report import check
from streamforge.ledger.store import read_ledger
from streamforge.pipeline import core
from streamforge.pipeline.cost import piece_row_costs
from streamforge.stages.layout_balance import _cap_for, balance_target, lay_out

WEIGHTS = [0.5, 0.3, 0.2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("balance"), np.random.default_rng(42))


def _coverage(batches):
    """Delivered tokens, checking no token comes twice."""
    rows = (b["segments"].reshape(-1, 5).numpy() for b in batches)
    return delivered_tokens(piece for seg in rows for piece in seg[seg[:, 0] >= 0].tolist())


# -- the layout --------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=120), st.sampled_from([16, 64, 256]),
       st.floats(0.05, 1.0))
def test_the_layout_puts_every_token_in_one_full_row(lengths, seq_len, density):
    lay = lay_out(lengths, seq_len, density * seq_len * seq_len)
    total = sum(lengths)
    rows = np.bincount(lay["row"], weights=lay["length"])
    assert (rows[:-1] == seq_len).all() and 0 < rows[-1] <= seq_len and len(rows) == -(-total // seq_len)
    for p, n in enumerate(lengths):  # each piece's parts tile it
        mine = lay["piece"] == p
        spans = sorted(zip(lay["offset"][mine].tolist(), lay["length"][mine].tolist()))
        assert spans[0][0] == 0 and sum(x for _, x in spans) == n
        assert all(a + n_ == b for (a, n_), (b, _) in zip(spans, spans[1:]))


@pytest.mark.skipif(core.ext is None, reason="the compiled core is not built, or STREAMFORGE_NO_EXT is set")
@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(0, 40_000), min_size=1, max_size=150), st.sampled_from([1, 7, 64, 2048, 8192]),
       st.floats(0.0, 1.0), st.integers(0, 2**32 - 1), st.booleans())
def test_the_compiled_layout_is_the_numpy_one(lengths, seq_len, density, seed, in_row_order):
    """The compiled core's layout (pipeline/_layout.c: the cap and the dealing) and numpy's
    give the same parts, bit for bit, on heavy-tailed lengths and any target."""
    x = np.array(lengths, np.int64)
    rng = np.random.default_rng(seed)
    x[rng.random(len(x)) < 0.3] //= 50  # many short pieces beside the long ones
    target = float(seq_len) * max(1.0, density * seq_len)
    got = lay_out(x, seq_len, target, in_row_order)
    saved = core.ext
    core.ext = None
    try:
        want = lay_out(x, seq_len, target, in_row_order)
    finally:
        core.ext = saved
    for key in want:
        assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key


@pytest.mark.skipif(core.ext is None, reason="the compiled core is not built, or STREAMFORGE_NO_EXT is set")
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 40_000), min_size=1, max_size=150), st.integers(1, 8192), st.floats(0.5, 9000.0),
       st.integers(0, 2**32 - 1))
def test_the_compiled_cap_is_the_numpy_one(lengths, hi, density, seed):
    """The compiled core's cap (pipeline/_layout.c bisects the grids that numpy scans) is
    numpy's, on any lengths, cap bound and density."""
    x = np.array(lengths, np.int64)
    x[np.random.default_rng(seed).random(len(x)) < 0.3] //= 50
    if x.sum() == 0:
        x[0] = 1
    got = _cap_for(x, density, hi)
    saved = core.ext
    core.ext = None
    try:
        want = _cap_for(x, density, hi)
    finally:
        core.ext = saved
    assert got == want


def test_the_target_is_a_function_of_the_lengths():
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.normal(np.log(600), 1.0, 20000)).astype(np.int64) + 1
    a = balance_target([lengths], [1.0], 8192, 64)
    assert a == balance_target([lengths.copy()], [1.0], 8192, 64)
    assert 0 < a < 8192 * 8192


# -- the cost in stats() -------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 10_000), st.sampled_from(["concat", "bestfit", "balance"]), st.integers(1, 3))
def test_the_cost_of_every_batch_is_the_sum_from_its_doc_ids(corpus, seed, packing, batch_size):
    ldr = loader(dataset(corpus, weights=WEIGHTS, packing=packing, seq_len=48, seed=seed), batch_size=batch_size)
    model = AttentionCost()
    for i, batch in zip(range(6), ldr):
        stats = ldr.stats()["step_cost"]
        rows = model.rows(batch["doc_ids"])
        assert stats["cost"] == pytest.approx(rows.sum()) and stats["max_row"] == pytest.approx(rows.max())
        assert stats["step"] == ldr.step - 1 and stats["rows"] == batch_size


def test_piece_costs_cut_pieces_at_row_ends():
    # pieces [0, 100) and [100, 160) over rows of 32: 32, 32, 32, 4 | 28, 32
    got = piece_row_costs([0, 100], [100, 60], 32, 5)
    assert got.tolist() == [32 ** 2, 32 ** 2, 32 ** 2, 4 ** 2 + 28 ** 2, 32 ** 2]


# -- every token once ----------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_token_once_with_balance(corpus, tmp_path, world, workers):
    url = tmp_path / "ledger"
    batches = []
    for rank in range(world):
        ds = dataset(corpus, weights=WEIGHTS, packing="balance", provenance=True, rank=rank, world_size=world)
        ldr = loader(ds, num_workers=workers, ledger_dir=str(url))
        got = take(ldr)
        assert all(int((b["doc_ids"] < 0).sum()) == 0 for b in got)  # full rows: no padding in a finite pass
        batches += got
    delivered = _coverage(batches)
    report = check(read_ledger(str(url)), {n: m for n, m in zip(ds.stream_names, ds.manifests)})
    assert report["ok"], report["problems"]
    (p,) = report["passes"]
    assert p["complete"] and p["delivered_tokens"] == delivered
    assert p["not_delivered_tokens"] == p["dropped_tokens"] <= p["drop_bound"]


def test_rows_cost_about_the_same(corpus):
    def spread(packing):
        ldr = loader(dataset(corpus, weights=WEIGHTS, packing=packing, seq_len=64), batch_size=1)
        costs = np.concatenate([AttentionCost().rows(b["doc_ids"]) for b in take(ldr)])
        return costs.std() / costs.mean()

    assert spread("balance") < 0.5 * spread("concat")


# -- resume ----------------------------------------------------------------------------------------
def test_resume_at_every_batch_boundary_is_exact(tmp_path):
    rng = np.random.default_rng(3)
    url = str(tmp_path / "s")
    write_stream(url, random_docs(rng, 70, 40))
    docs = [Stream(url, name="s")]

    def build():
        return StreamingLoader(dataset_of(docs), batch_size=3)

    def dataset_of(streams):
        from streamforge import PackedTokenDataset
        return PackedTokenDataset(streams, seq_len=24, packing="balance", shuffle_buffer=16, shuffle_warmup=4,
                                  provenance=True)

    first = build()
    reference, states = [], [json.loads(json.dumps(first.state_dict()))]
    for batch in first:
        reference.append({k: v.clone() for k, v in batch.items()})
        states.append(json.loads(json.dumps(first.state_dict())))
    assert len(reference) > 64 // 3 + 2  # past the first window
    for cut, state in enumerate(states[:-1]):  # (after the last batch a resume starts the next pass)
        resumed = build()
        resumed.load_state_dict(state)
        assert resumed.resume_report.mode == "exact"
        assert_batches_equal(take(resumed), reference[cut:])


# -- mixture ----------------------------------------------------------------------------------------
def test_a_stream_at_a_tenth_keeps_its_share(tmp_path):
    rng = np.random.default_rng(5)
    written = []
    for name, median in (("big", 60), ("small", 200)):
        written += write_stream(str(tmp_path / name), random_docs(rng, 400, median))
    streams = [Stream(str(tmp_path / "big"), weight=0.9, name="big"),
               Stream(str(tmp_path / "small"), weight=0.1, name="small")]
    from streamforge import PackedTokenDataset
    shares = {}
    for packing in ("concat", "balance"):
        ds = PackedTokenDataset(streams, seq_len=32, packing=packing, infinite=True, shuffle_buffer=64)
        ldr = StreamingLoader(ds, batch_size=4)
        take(ldr, 400)
        tokens = ldr.stats()["streams"]
        shares[packing] = tokens["small"]["tokens"] / (tokens["small"]["tokens"] + tokens["big"]["tokens"])
    # today's bound (test_mixing: about two of the longest documents per worker), plus the
    # balanced window of 64 rows, over the 400 * 4 * 32 tokens
    longest = max(len(d) + 1 for d in written)
    total = 400 * 4 * 32
    assert abs(shares["balance"] - 0.1) * total <= 2 * longest + 64 * 32, shares
    assert abs(shares["balance"] - 0.1) <= abs(shares["concat"] - 0.1) + 64 * 32 / total, shares


# -- refusals ----------------------------------------------------------------------------------------
def test_refused_where_it_cannot_hold(corpus):
    with pytest.raises(ConfigError, match="seq_len"):
        dataset(corpus, packing="balance", seq_len=[(0, 32), (10, 64)])
    url = corpus["web"][0]
    with pytest.raises(ConfigError, match="balance"):
        EvaluationDataset(url, seq_len=32, packing="balance")


@pytest.mark.parametrize("workers", [0, 2])
def test_elastic_resume_from_2_to_3_ranks_covers_the_pass_once(corpus, workers, tmp_path):
    """A pass saved on 2 ranks inside their balanced windows, finished on 3: every token once
    (the windows' rests are part of the saved work), nothing lost beyond the drop bounds."""
    from streamforge import merge_states, unpack_state
    from streamforge.resume.state import saved_workers

    def build(world, w):
        return [loader(dataset(corpus, weights=WEIGHTS, packing="balance", provenance=True, seq_len=48, rank=r,
                               world_size=world), num_workers=w, batch_size=3, ledger_dir=str(tmp_path / "ledger"))
                for r in range(world)]

    def run(loaders, steps=None):
        out = []
        for ld in loaders:
            it = iter(ld)
            while steps is None or ld.step < steps:
                try:
                    out.append(next(it))
                except StopIteration:
                    break
            it.close()
        return out

    first = build(2, workers)
    bound = first[0].plan().drop_bound()
    cut = first[0].steps_per_pass // 2 + 2  # inside a window (of 64 rows: 21 1/3 batches of 3)
    before = run(first, cut)
    state = json.loads(json.dumps(merge_states([ld.state_dict() for ld in first])))
    saved = [w for _, w in saved_workers(unpack_state(state)) if w]
    assert any(isinstance(w["packer"]["window"], dict) for w in saved)  # saved inside a window
    resumed = build(3, 0)
    for ld in resumed:
        ld.load_state_dict(state)
        assert ld.resume_report.mode == "elastic", str(ld.resume_report)
    bound += resumed[0].plan().drop_bound()
    after = run(resumed)
    delivered = _coverage(before + after)
    total = sum(len(d) + 1 for _, docs in corpus.values() for d in docs if len(d))
    assert 0 <= total - delivered <= bound
    for ld in resumed:
        ld.ledger.close()
    report = check(read_ledger(str(tmp_path / "ledger")))
    assert report["ok"], report["problems"]
    (p,) = report["passes"]
    assert p["delivered_tokens"] == delivered


def test_the_bench_tool_runs(capsys):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import bench_balance

    bench_balance.main(["--seq-len", "256", "--ranks", "2", "--steps", "4", "--loader-steps", "0", "--no-write"])
    out = capsys.readouterr().out
    assert "| 256 | 2 |" in out
