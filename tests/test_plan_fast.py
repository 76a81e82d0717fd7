"""The vectorized cuts (``planning/layout.py``) against the per-cut reference they replaced
(``helpers/plan_reference.py``): the very same ranges on random corpora, with and without
record lengths, for all workers and for a few alone; and a planner's whole pass plan against
one assembled from the reference."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import plan_reference as ref
from streamforge.format.manifest import Manifest, shard_name
from streamforge.planning.layout import Layout
from streamforge.planning.plan import build_pass_plan, cut_shards, plan_stream
from streamforge.planning.planner import Planner

# heavy-tailed record lengths, empty records and empty shards included
lengths_st = st.lists(
    st.lists(st.one_of(st.integers(0, 40), st.integers(0, 5000), st.just(0)), min_size=0, max_size=30),
    min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, workers=st.integers(1, 90), seed=st.integers(0, 2**32), pass_idx=st.integers(0, 3),
       data=st.data())
def test_fast_cuts_equal_the_reference(lengths, workers, seed, pass_idx, data):
    records = [len(x) for x in lengths]
    exact_tokens = [sum(x) for x in lengths]
    # without record lengths the manifest's tokens may be anything (estimated cuts)
    tokens = data.draw(st.sampled_from([exact_tokens, [t * 3 + 1 for t in exact_tokens]]))
    args = dict(seed=seed, stream_key="s", pass_idx=pass_idx, num_global_workers=workers)
    record_tokens = lambda shard: np.asarray(lengths[shard], np.int64)  # noqa: E731
    assert plan_stream(records, tokens, **args) == ref.plan_stream(records, tokens, **args)
    fast = plan_stream(records, exact_tokens, record_tokens=record_tokens, **args)
    assert fast == ref.plan_stream(records, exact_tokens, record_tokens=record_tokens, **args)
    some = data.draw(st.lists(st.integers(0, workers - 1), max_size=5))
    assert plan_stream(records, exact_tokens, record_tokens=record_tokens, workers=some, **args) == [fast[g] for g in some]
    assert cut_shards(records, exact_tokens, workers=some or None, **args) == ref.cut_shards(
        records, exact_tokens, workers=some or None, **args)


def test_fast_cuts_equal_the_reference_at_scale():
    """Thousands of shards, lognormal lengths, more workers than shards and fewer."""
    rng = np.random.default_rng(5)
    per_shard = [rng.lognormal(6, 1.2, int(n)).astype(np.int64) for n in rng.poisson(40, 3000)]
    records = [len(x) for x in per_shard]
    tokens = [int(x.sum()) for x in per_shard]
    record_tokens = per_shard.__getitem__
    for workers in (7, 1000, 4096, 8192):
        args = dict(seed=3, stream_key="web", pass_idx=1, num_global_workers=workers)
        fast = plan_stream(records, tokens, record_tokens=record_tokens, **args)
        assert fast == ref.plan_stream(records, tokens, record_tokens=record_tokens, **args)
        layout = Layout(records, tokens, 3, "web", 1, workers)
        cuts = layout.cuts(range(workers + 1), lambda shards: [np.concatenate([[0], np.cumsum(per_shard[s])])
                                                               for s in shards])
        assert np.all(np.diff(cuts) >= 0) and cuts[-1] == sum(records)


class _Source:
    def __init__(self, lengths):
        self.lengths = lengths
        self.config = type("C", (), {"on_error": "raise"})()

    def index(self, shard):
        return type("I", (), {"records": {"num_tokens": np.asarray(self.lengths[shard], np.uint32)}})()


def _manifest(lengths):
    n = np.array([len(x) for x in lengths], np.int64)
    tokens = np.array([sum(x) for x in lengths], np.int64)
    docs = np.array([sum(1 for v in x if v > 0) for x in lengths], np.int64)
    return Manifest(token_dtype="uint16", shard_names=[shard_name(i) for i in range(len(n))],
                    shard_sha256=["0" * 64] * len(n),
                    columns={"bytes": tokens * 2, "num_records": n, "num_tokens": tokens, "num_frames": n,
                             "index_offset": tokens * 2, "index_bytes": n * 16, "num_docs": docs}, eos_id=0)


@settings(max_examples=60, deadline=None)
@given(streams=st.lists(lengths_st, min_size=1, max_size=3), world=st.integers(1, 6), per_rank=st.integers(1, 4),
       seed=st.integers(0, 1000))
def test_planner_pass_plan_equals_the_reference(streams, world, per_rank, seed):
    names = [f"s{i}" for i in range(len(streams))]
    sources = [_Source(x) for x in streams]
    planner = Planner(names, [_manifest(x) for x in streams], seed=seed, sources=sources.__getitem__)
    kw = dict(world_size=world, workers_per_rank=per_rank, batch_size=2, seq_len=16, packing="concat")
    plan = planner.pass_plan(0, eos_appended=[True] * len(streams), **kw)
    n = world * per_rank
    ranges = [ref.plan_stream([len(x) for x in lengths], [sum(x) for x in lengths], seed=seed, stream_key=name,
                              pass_idx=0, num_global_workers=n, record_tokens=lambda k, x=lengths: np.asarray(x[k]))
              for name, lengths in zip(names, streams)]

    def totals(s, rs):
        got = [v for shard, a, b in rs for v in streams[s][shard][a:b]]
        return sum(got), sum(1 for v in got if v > 0)

    expected = build_pass_plan(ranges, totals, streams=names, eos_appended=[True] * len(streams), pass_idx=0, **kw)
    assert plan == expected
