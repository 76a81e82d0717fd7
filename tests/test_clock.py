"""The job clock: equal full batches on every rank, global steps, the drop bound."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.pipeline import dataset, loader, random_docs, take, write_stream
from streamforge.planning.plan import PassPlan
from streamforge.resume.state import saved_ranks, unpack_state


def _skewed_corpus(root, rng, kind):
    """Corpora that stress the plan: a few huge documents, one tiny stream, few shards."""
    if kind == "huge-docs":
        web = random_docs(rng, 200, 40) + [rng.integers(1, 999, size=3000).astype(np.uint16) for _ in range(4)]
        rng.shuffle(web)
        spec = {"web": web, "code": random_docs(rng, 60, 150)}
    elif kind == "tiny-stream":
        spec = {"web": random_docs(rng, 300, 60), "code": random_docs(rng, 80, 200), "tiny": random_docs(rng, 4, 20)}
    else:  # few shards: every stream fits in one or two shards
        spec = {"web": random_docs(rng, 60, 40), "code": random_docs(rng, 20, 90)}
    size = "64KiB" if kind == "few-shards" else "8KiB"
    corpus = {}
    for name, docs in spec.items():
        url = str(root / kind / name)
        corpus[name] = (url, write_stream(url, docs, shard_size=size))
    return corpus


@pytest.fixture(scope="module", params=["huge-docs", "tiny-stream", "few-shards"])
def skewed(request, tmp_path_factory):
    return request.param, _skewed_corpus(tmp_path_factory.mktemp("skew"), np.random.default_rng(5), request.param)


def _run_ranks(corpus, world_size, num_workers, **kwargs):
    batch_size = kwargs.pop("batch_size", 2)
    out = []
    for rank in range(world_size):
        ds = dataset(corpus, provenance=True, rank=rank, world_size=world_size, **kwargs)
        ldr = loader(ds, num_workers=num_workers, batch_size=batch_size)
        plan = ldr.plan()
        steps = ldr.steps_per_pass  # known before the first batch
        batches = take(ldr)
        out.append((plan, steps, batches, ldr.stats()))
    return out


@pytest.mark.parametrize("world_size,num_workers", [(2, 0), (3, 2), (4, 2)])
@pytest.mark.parametrize("packing", ["concat", "bestfit", "pad"])
def test_equal_full_batches_on_every_rank(skewed, world_size, num_workers, packing):
    kind, corpus = skewed
    seq_len, batch_size = 32, 2
    runs = _run_ranks(corpus, world_size, num_workers, packing=packing, seq_len=seq_len, batch_size=batch_size)
    plans = [r[0] for r in runs]
    assert all(p.to_dict() == plans[0].to_dict() for p in plans), "ranks disagree on the plan"
    for plan, steps, batches, stats in runs:
        assert len(batches) == steps == plan.steps > 0
        for b in batches:
            for key, value in b.items():
                if key != "segments":
                    assert tuple(value.shape) == (batch_size, seq_len), key
        assert stats["padded_rows"] == 0 if "padded_rows" in stats else True
    delivered = sum(int((b["doc_ids"] >= 0).sum()) for r in runs for b in r[2])
    dropped = sum(r[3]["dropped_tokens"] for r in runs)
    assert delivered + dropped == sum(plans[0].tokens)  # token conservation
    if packing == "concat":
        assert dropped == plans[0].dropped_tokens() <= plans[0].drop_bound()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(0, 400), min_size=1, max_size=60),
    world_size=st.integers(1, 4),
    workers=st.integers(1, 3),
    batch_size=st.integers(1, 3),
    seq_len=st.integers(4, 48),
    packing=st.sampled_from(["concat", "bestfit", "pad"]),
)
def test_plan_steps_fit_every_worker(tmp_path_factory, lengths, world_size, workers, batch_size, seq_len, packing):
    """Property: every in-process worker can fill its share of the steps with full batches."""
    rng = np.random.default_rng(len(lengths))
    docs = [rng.integers(1, 999, size=n).astype(np.uint16) for n in lengths]
    if not any(len(d) for d in docs):
        docs.append(np.arange(1, 4, dtype=np.uint16))
    url = str(tmp_path_factory.mktemp("p") / "s")
    write_stream(url, docs, shard_size="1KiB", frame_size="256B")
    corpus = {"s": (url, docs)}
    for rank in range(world_size):
        ds = dataset(corpus, rank=rank, world_size=world_size, packing=packing, seq_len=seq_len, shuffle_buffer=5)
        plan = ds.pass_plan(0, workers_per_rank=workers, batch_size=batch_size)
        assert json.loads(json.dumps(plan.to_dict())) == plan.to_dict()
        assert PassPlan.from_dict(plan.to_dict()) == plan
        assert sum(plan.batches_of(w) for w in range(workers)) == plan.steps
        for w in range(workers):
            pipeline = ds.make_pipeline(w, workers, quota=plan.batches_of(w))
            built = 0
            while (rows := pipeline.next_batch(batch_size)) is not None:
                assert rows.num_rows == batch_size
                built += 1
            assert built == plan.batches_of(w) and pipeline.padded_rows == 0
            pipeline.close()


def test_steps_continue_across_passes_and_in_infinite_mode(tmp_path):
    rng = np.random.default_rng(1)
    corpus = {"web": (str(tmp_path / "web"), write_stream(str(tmp_path / "web"), random_docs(rng, 80, 50)))}
    ldr = loader(dataset(corpus, provenance=True), num_workers=0)
    first = ldr.steps_per_pass
    take(ldr)
    assert ldr.step == first
    second = ldr.steps_per_pass
    take(ldr)
    assert ldr.step == first + second and ldr.stats()["pass"] == 2
    inf = loader(dataset(corpus, infinite=True), num_workers=2)
    take(inf, 3 * first)
    assert inf.step == 3 * first


def test_state_records_who_saved_it(tmp_path):
    rng = np.random.default_rng(2)
    corpus = {"web": (str(tmp_path / "web"), write_stream(str(tmp_path / "web"), random_docs(rng, 80, 50)))}
    ldr = loader(dataset(corpus, rank=1, world_size=2), num_workers=2)
    take(ldr, 3)
    state = ldr.state_dict()
    inner = unpack_state(state)
    assert (saved_ranks(inner), inner["world_size"], inner["workers_per_rank"], inner["step"]) == ([1], 2, 2, 3)


def test_plan_counts_read_only_the_split_shards(tmp_path):
    """With the manifest's per-shard document counts, a plan reads the record index of the
    shards a cut splits and no others; without them (older manifests) it reads every shard's
    index, and the counts are the same."""
    rng = np.random.default_rng(4)
    url = str(tmp_path / "web")
    corpus = {"web": (url, write_stream(url, random_docs(rng, 400, 50, min_len=0), shard_size="4KiB"))}
    ds = dataset(corpus, world_size=1, rank=0)
    manifest = ds.manifests[0]
    assert "num_docs" in manifest.columns and manifest.num_shards > 6
    plan = ds.pass_plan(0, workers_per_rank=3, batch_size=2)
    split = {s for worker in plan.ranges[0] for s, a, b in worker if (a, b) != (0, manifest.columns["num_records"][s])}
    assert ds._index_sources[0].counters["index_requests"] == len(split) <= 2
    old = dataset(corpus, world_size=1, rank=0)
    del old.manifests[0].columns["num_docs"]
    assert old.pass_plan(0, workers_per_rank=3, batch_size=2).tokens == plan.tokens
    assert old._index_sources[0].counters["index_requests"] == manifest.num_shards
