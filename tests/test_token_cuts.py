"""Token cuts (``cuts="tokens"``): every token of a finite pass delivered once, the last step
padded, save two tokens per stream and worker; exact resume inside a cut document; the cut
arithmetic as a property."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.pipeline import assert_batches_equal, dataset, loader, random_docs, take, write_stream
from streamforge.errors import ConfigError
from streamforge.ledger.report import check
from streamforge.ledger.store import read_ledger
from streamforge.planning.layout import Layout
from streamforge.planning.plan import PassPlan
from streamforge.planning.token_cuts import CutSpec, cut_stream, trims


def _long_docs_corpus(root):
    """A corpus where record cuts drop a lot: a few long documents in few shards."""
    rng = np.random.default_rng(11)
    spec = {"web": random_docs(rng, 120, 40), "books": random_docs(rng, 10, 900, sigma=0.6)}
    out = {}
    for name, docs in spec.items():
        url = str(root / name)
        out[name] = (url, write_stream(url, docs, shard_size="16KiB"))
    return out


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    return _long_docs_corpus(tmp_path_factory.mktemp("cuts"))


def _pass(corpus, world, workers, cuts, batch_size=2, **kwargs):
    runs = []
    for rank in range(world):
        ds = dataset(corpus, provenance=True, rank=rank, world_size=world, seq_len=32, cuts=cuts, **kwargs)
        ldr = loader(ds, num_workers=workers, batch_size=batch_size)
        plan = ldr.plan()
        runs.append((plan, take(ldr), ldr.stats()))
    return runs


def _pieces(batches):
    segs = np.concatenate([b["segments"].numpy().reshape(-1, 5) for b in batches])
    return segs[segs[:, 0] >= 0]


def _exactly_once(corpus, pieces):
    """Every piece inside its document (with EOS), no token twice; returns tokens delivered."""
    names = list(corpus)
    seen = {}
    for stream, shard, record, start, length in pieces.tolist():
        seen.setdefault((stream, shard, record), []).append((start, start + length))
    for key, spans in seen.items():
        spans.sort()
        for (a, b), (c, _) in zip(spans, spans[1:]):
            assert b <= c, f"{names[key[0]]} shard {key[1]} record {key[2]}: tokens delivered twice"
    return int(pieces[:, 4].sum())


@pytest.mark.parametrize("world,workers", [(2, 0), (3, 2)])
def test_every_token_once_and_less_than_a_step_dropped(books, world, workers):
    old = _pass(books, world, workers, "records")
    new = _pass(books, world, workers, "tokens")
    plan = new[0][0]
    assert all(r[0].to_dict() == plan.to_dict() for r in new)  # every rank computes the same plan
    assert PassPlan.from_dict(plan.to_dict()) == plan
    delivered = _exactly_once(books, np.concatenate([_pieces(r[1]) for r in new]))
    dropped = sum(r[2]["dropped_tokens"] for r in new)
    whole = sum(plan.tokens) + sum(plan.unassigned)
    corpus_tokens = sum(len(d) + 1 for _, docs in books.values() for d in docs if len(d))
    assert whole == corpus_tokens == delivered + dropped
    # the last step is padded: at most two tokens per stream and global worker dropped
    assert dropped == plan.dropped_tokens() <= 2 * 2 * world * max(workers, 1) == plan.drop_bound()
    assert plan.last_step == "pad" and all(len(r[1]) == plan.steps for r in new)
    for r in new:  # static shapes, padding only in the last step, counted by stats()
        assert all(tuple(b["input_ids"].shape) == (2, 32) for b in r[1])
        assert all((b["doc_ids"] >= 0).all() for b in r[1][:-1])
        assert r[2]["padding_tokens"] == int((r[1][-1]["doc_ids"] < 0).sum())
    old_dropped = sum(r[2]["dropped_tokens"] for r in old)
    assert old_dropped > 3 * dropped  # record cuts left whole documents' worth


def test_exact_resume_inside_cut_documents(books):
    ds = lambda: dataset(books, provenance=True, seq_len=32, cuts="tokens", world_size=2, rank=1)  # noqa: E731
    reference = take(loader(ds(), num_workers=2, batch_size=2))
    plan = loader(ds(), num_workers=2, batch_size=2).plan()
    assert any(c != [0, 0] for stream in plan.cuts for c in stream)  # documents are cut
    # save at steps where a piece of a cut document is being delivered, and resume
    heads = {(s, r) for stream, cuts, ranges in zip(range(2), plan.cuts, plan.ranges)
             for (h, _), rs in zip(cuts, ranges) if h for s, r in [rs[0][:2]]}
    inside = [i for i, b in enumerate(reference)
              if any((s, r) in heads for _, s, r, _, _ in _pieces([b]).tolist())]
    assert inside
    for cut in sorted({inside[0], inside[len(inside) // 2], len(reference) // 3})[:3]:
        first = loader(ds(), num_workers=2, batch_size=2)
        it = iter(first)
        head = [{k: v.clone() for k, v in next(it).items()} for _ in range(cut + 1)]
        state = first.state_dict()
        it.close()
        assert_batches_equal(head, reference[: cut + 1])
        resumed = loader(ds(), num_workers=2, batch_size=2)
        resumed.load_state_dict(state)
        assert_batches_equal(take(resumed), reference[cut + 1 :])


@pytest.mark.parametrize("mode,at", [("elastic", 3), ("elastic", 10), ("elastic", 40), ("statistical", 10)])
def test_resume_on_another_topology(books, mode, at):
    """Elastic: the rest of the pass re-planned over 3 workers, every token exactly once, the
    pieces of cut documents each read through their own cut, and every token delivered or
    counted dropped. Statistical: each stream goes on at the same fraction; nothing twice after
    the resume."""
    first = loader(dataset(books, provenance=True, seq_len=32, cuts="tokens"), num_workers=2, batch_size=2)
    it = iter(first)
    head = [{k: v.clone() for k, v in next(it).items()} for _ in range(at)]
    state = first.state_dict()
    it.close()
    resumed = loader(dataset(books, provenance=True, seq_len=32, cuts="tokens"), num_workers=3, batch_size=2)
    resumed.load_state_dict(state, mode="statistical" if mode == "statistical" else None)
    assert resumed.resume_report.mode == mode
    rest = resumed.plan()
    tail = take(resumed)
    if mode == "elastic":
        delivered = _exactly_once(books, np.concatenate([_pieces(head), _pieces(tail)]))
        whole = sum(len(d) + 1 for _, docs in books.values() for d in docs if len(d))
        assert delivered + resumed.stats()["dropped_tokens"] == whole
        assert any("trims" in u for s in rest.windows for w in s for u in w)  # pieces of cut documents
        # the rest is re-planned at token positions too, its last step padded: it drops the
        # two tokens per stream and new worker, not documents
        assert resumed.stats()["dropped_tokens"] == rest.dropped_tokens() <= 2 * 2 * 3
        assert rest.last_step == "pad" and len(tail) == rest.steps
    else:
        _exactly_once(books, _pieces(tail))


def _clone(it, n):
    return [{k: v.clone() for k, v in next(it).items()} for _ in range(n)]


def test_exact_resume_at_the_padded_last_step(books):
    """Saved just before the padded last step, and just after it (the pass's end): the resumed
    loader gives the uninterrupted run's batches, the padded step and the next pass included."""
    ds = lambda: dataset(books, provenance=True, seq_len=32, cuts="tokens")  # noqa: E731
    ref = loader(ds(), num_workers=2, batch_size=2)
    reference = take(ref) + take(ref)  # two passes
    steps = ref.plan().steps
    assert len(reference) == 2 * steps and (reference[steps - 1]["doc_ids"] < 0).any()  # padded
    assert ref.stats()["pass_dropped_tokens"] <= 2 * 2 * 2
    for cut in (steps - 1, steps):
        first = loader(ds(), num_workers=2, batch_size=2)
        it = iter(first)
        head = _clone(it, cut)
        state = first.state_dict()
        it.close()
        resumed = loader(ds(), num_workers=2, batch_size=2)
        resumed.load_state_dict(state)
        assert resumed.resume_report.mode == "exact"
        rest = take(resumed) if cut < steps else []
        assert_batches_equal(head + rest + take(resumed), reference)


def test_elastic_resume_across_the_padded_last_step(books):
    """Saved one step before the pass's padded last step, resumed on 3 workers: the rest (less
    than a step) becomes one padded step of the new topology; every token once."""
    ds = lambda: dataset(books, provenance=True, seq_len=32, cuts="tokens")  # noqa: E731
    first = loader(ds(), num_workers=2, batch_size=2)
    steps = first.plan().steps
    it = iter(first)
    head = _clone(it, steps - 2)
    state = first.state_dict()
    it.close()
    resumed = loader(ds(), num_workers=3, batch_size=2)
    resumed.load_state_dict(state)
    assert resumed.resume_report.mode == "elastic"
    rest = resumed.plan()
    tail = take(resumed)
    assert rest.last_step == "pad" and len(tail) == rest.steps and rest.steps >= 1
    assert all(tuple(b["input_ids"].shape) == (2, 32) for b in tail)
    delivered = _exactly_once(books, np.concatenate([_pieces(head), _pieces(tail)]))
    whole = sum(len(d) + 1 for _, docs in books.values() for d in docs if len(d))
    assert delivered + resumed.stats()["dropped_tokens"] == whole
    assert resumed.stats()["dropped_tokens"] <= 2 * 2 * 3 + 2 * 2 * 2


@pytest.mark.parametrize("workers", [0, 2])
def test_the_ledger_checks_a_token_cut_pass(books, tmp_path, workers):
    """The ledger proves the pass exactly once, every record reached, and the tokens not
    delivered are the plan's dropped ones, under one global step."""
    ldr = loader(dataset(books, provenance=True, seq_len=32, cuts="tokens"), num_workers=workers,
                 ledger_dir=str(tmp_path / "ledger"))
    batches = take(ldr)
    ledger = read_ledger(str(tmp_path / "ledger"))
    report = check(ledger, {n: m for n, m in zip(ldr.dataset.stream_names, ldr.dataset.manifests)})
    assert report["ok"], report["problems"]
    (p,) = report["passes"]
    assert p["complete"] and p["delivered_tokens"] == sum(int((b["doc_ids"] >= 0).sum()) for b in batches)
    assert p["not_delivered_tokens"] == p["dropped_tokens"] == ldr.stats()["dropped_tokens"] <= p["drop_bound"]
    assert p["dropped_tokens"] <= 2 * 2 * max(workers, 1)  # the last step padded
    for name, counts in p["records_never_reached"].items():
        assert counts["never_reached"] == 0, name


def test_infinite_passes_drop_nothing(books):
    """infinite=True: each stream cut at its token quantiles, nothing left over; a worker's
    pass runs on into the next, so every token of pass 0 comes out before pass 1 ends."""
    ds = dataset(books, provenance=True, seq_len=32, cuts="tokens", infinite=True)
    ldr = loader(ds, num_workers=2, batch_size=2)
    plan = ldr.plan()
    assert sum(plan.unassigned) == 0 and plan.dropped_tokens() <= 2 * 2 * 32 + 2 * 2 * 2
    whole = sum(len(d) + 1 for _, docs in books.values() for d in docs if len(d))
    assert sum(plan.tokens) == whole
    batches = take(ldr, 2 * whole // (2 * 32) + 10)
    segs = np.concatenate([b["segments"].numpy().reshape(-1, 5) for b in batches])
    assert not ldr.stats().get("dropped_tokens")
    first = segs[(segs[:, 0] >= 0)]
    pass0 = {}
    for stream, shard, record, start, length in first.tolist():
        pass0.setdefault((stream, shard, record), set()).update(range(start, start + length))
    names = list(books)
    from streamforge.source import ShardSource
    for s, name in enumerate(names):
        src = ShardSource.open(books[name][0])
        for shard in range(src.manifest.num_shards):
            for r, n in enumerate(src.index(shard).records["num_tokens"].tolist()):
                if n:
                    assert pass0.get((s, shard, r), set()) >= set(range(n + 1)), (name, shard, r)


def test_chained_elastic_resumes(books):
    """2 -> 3 -> 1 workers: the second resume reads the first's saved work, pieces and the
    pass's rest included: every token once, delivered or counted dropped."""
    ds = lambda: dataset(books, provenance=True, seq_len=32, cuts="tokens")  # noqa: E731
    first = loader(ds(), num_workers=2, batch_size=2)
    it = iter(first)
    head = [{k: v.clone() for k, v in next(it).items()} for _ in range(5)]
    state = first.state_dict()
    it.close()
    second = loader(ds(), num_workers=3, batch_size=2)
    second.load_state_dict(state)
    it = iter(second)
    middle = [{k: v.clone() for k, v in next(it).items()} for _ in range(20)]
    state = second.state_dict()
    it.close()
    third = loader(ds(), num_workers=1, batch_size=2)
    third.load_state_dict(state)
    assert third.resume_report.mode == "elastic"
    tail = take(third)
    delivered = _exactly_once(books, np.concatenate([_pieces(head), _pieces(middle), _pieces(tail)]))
    whole = sum(len(d) + 1 for _, docs in books.values() for d in docs if len(d))
    assert delivered + third.stats()["dropped_tokens"] == whole


def test_refusals(books):
    with pytest.raises(ConfigError, match="batch_size"):
        loader(dataset(books, cuts="tokens"), batch_size=[(0, 1), (5, 2)]).plan()
    with pytest.raises(ConfigError, match="cuts"):
        dataset(books, cuts="bytes")
    with pytest.raises(ConfigError, match="concat"):
        dataset(books, cuts="tokens", packing="pad")
    with pytest.raises(ConfigError, match="seq_len"):
        dataset(books, cuts="tokens", seq_len=[(0, 16), (10, 32)])


# -- the arithmetic, as a property ----------------------------------------------------------------
def _stream(rng, shards, mean, tail):
    """Records per shard and heavy-tailed (Pareto) lengths, some empty."""
    counts = rng.integers(1, 30, size=shards)
    lengths = (rng.pareto(tail, size=int(counts.sum())) * mean).astype(np.int64) + 1
    lengths[rng.random(len(lengths)) < 0.05] = 0
    return counts, lengths


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    world=st.integers(1, 16),
    workers=st.integers(1, 4),
    batch=st.integers(1, 4),
    seq_len=st.sampled_from([8, 64, 256]),
    streams=st.integers(1, 3),
    tail=st.floats(0.8, 3.0),
    eos=st.booleans(),
)
def test_cut_arithmetic(seed, world, workers, batch, seq_len, streams, tail, eos):
    """Over random topologies and heavy-tailed corpora: every token (EOS included) of every
    stream goes to at most one worker, each worker gets at least its batches' tokens, and what
    the pass drops is at most one global step plus two tokens per stream and global worker."""
    _check_cuts(seed, world, workers, batch, seq_len, streams, tail, eos)


def _check_cuts(seed, world, workers, batch, seq_len, streams, tail, eos, big=False):
    rng = np.random.default_rng(seed)
    spec = CutSpec(world, workers, batch, seq_len)
    shards, mean = ((200, 400), (100, 400)) if big else ((1, 40), (5, 400))
    corpus = [_stream(rng, int(rng.integers(*shards)), int(rng.integers(*mean)), tail) for _ in range(streams)]
    sizes = [l + (l > 0) * eos for _, l in corpus]
    shard_tokens = [np.add.reduceat(s, np.cumsum(c) - c) for (c, _), s in zip(corpus, sizes)]
    steps, budget = spec.budgets([int(t.sum()) for t in shard_tokens])
    got = np.zeros(spec.n, np.int64)
    given_total = 0
    for s, ((counts, _), size) in enumerate(zip(corpus, sizes)):
        starts = np.concatenate([[0], np.cumsum(counts)])
        layout = Layout(counts, shard_tokens[s], seed, f"s{s}", 0, spec.n)
        ends = lambda shards, st=starts, sz=size: [  # noqa: E731
            np.concatenate([[7], 7 + np.cumsum(sz[st[k]:st[k + 1]])]) for k in shards]  # sums need not start at 0
        ranges, tokens = cut_stream(layout, shard_tokens[s], budget[s], ends, eos)
        alone = cut_stream(layout, shard_tokens[s], budget[s], ends, eos, [spec.n - 1])[0][0]
        assert list(alone) == list(ranges[-1]) and alone.cut == ranges[-1].cut  # a worker's own two cuts
        owner = np.zeros(int(sizes[s].sum()), np.int64)  # tokens of the stream, by record, with EOS
        first = np.concatenate([[0], np.cumsum(size)])
        for rs, t in zip(ranges, tokens):
            held = 0
            cut = trims(rs)
            for shard, a, b in rs:
                for r in range(a, b):
                    i = starts[shard] + r
                    lo, hi = cut.get((shard, r), (0, 0))
                    hi = hi or int(size[i])
                    assert 0 <= lo < hi <= size[i] or size[i] == 0
                    owner[first[i] + lo : first[i] + hi] += 1
                    held += max(hi - lo, 0)
            assert held == t
        assert owner.max(initial=0) <= 1  # no token twice
        got += tokens
        given_total += int(tokens.sum())
    per_batch = batch * seq_len
    whole = sum(int(t.sum()) for t in shard_tokens)
    assert int(got.sum()) == whole  # every token to a worker: the last step is padded
    if whole == 0:
        assert steps == 0
        return whole, 0
    assert (got >= spec.batches(steps - 1) * per_batch).all()  # every worker fills its full batches
    cap = spec.batches(steps) * per_batch
    owners = spec.last_owners(steps - 1)
    assert (spec.batches(steps) - spec.batches(steps - 1) == np.isin(np.arange(spec.n), owners)).all()
    dropped = int(np.maximum(got - cap, 0).sum())  # held past the batches' capacity
    padding = int(np.maximum(cap - got, 0).sum())
    assert 0 <= dropped <= 2 * streams * spec.n  # two tokens per stream and global worker at most
    assert 0 <= padding < world * per_batch and padding == int(cap.sum()) - (whole - dropped)
    if whole >= 1000 * (2 * streams * spec.n):
        assert dropped <= 0.001 * whole  # the 0.1% bound
    return whole, dropped


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), world=st.integers(1, 3), workers=st.integers(1, 3), streams=st.integers(1, 3),
       tail=st.floats(0.8, 3.0))
def test_cut_arithmetic_on_long_passes(seed, world, workers, streams, tail):
    """The same property where every pass holds thousands of steps: dropped <= 0.1% of it."""
    whole, dropped = _check_cuts(seed, world, workers, 1, 8, streams, tail, True, big=True)
    assert whole >= 1000 * (world * 8 + 2 * streams * world * workers) and dropped <= 0.001 * whole


def test_plan_of_a_worker_alone_equals_its_part(books):
    ds = dataset(books, seq_len=32, cuts="tokens", world_size=2, rank=0)
    plan = ds.pass_plan(0, workers_per_rank=3, batch_size=2)
    other = dataset(books, seq_len=32, cuts="tokens", world_size=2, rank=0)
    other.pass_plan(0, workers_per_rank=3, batch_size=2)  # sets the cut spec, like the loader
    other.planner._ranges.clear()
    for s in range(2):
        for g in range(6):
            alone = other.planner.worker_ranges(s, 0, 6, g)
            assert list(alone) == list(plan.ranges[s][g]) and list(alone.cut) == plan.cuts[s][g]
    assert SimpleNamespace(**plan.to_dict()).cuts == plan.cuts


# -- real ranks ---------------------------------------------------------------------------------------
def test_torchrun_finite_pass_delivers_every_token(tmp_path):
    """2 ranks under torchrun (gloo), 2 workers each, a corpus with long documents: record cuts
    drop whole documents' worth of tokens; token cuts end the pass in a padded step and drop
    at most two tokens per stream and global worker, and every token is delivered once over
    both ranks."""
    from pathlib import Path

    from helpers.torchrun import torchrun

    rng = np.random.default_rng(41)
    spec = {"web": random_docs(rng, 500, 200), "books": random_docs(rng, 70, 3000, sigma=0.5)}
    urls = []
    for name, docs in spec.items():
        url = str(tmp_path / name)
        write_stream(url, docs, shard_size="256KiB", frame_size="16KiB")
        urls.append(url)
    out = tmp_path / "out"
    out.mkdir()
    torchrun(Path(__file__).parent / "helpers" / "workers" / "cuts_worker.py", out, *urls)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    whole = sum(len(d) + 1 for docs in spec.values() for d in docs if len(d))
    figures = {}
    for i, cuts in enumerate(("records", "tokens")):
        runs = [r["runs"][i] for r in ranks]
        assert {r["steps"] for r in runs} == {runs[0]["batches"]} and runs[1]["batches"] == runs[0]["batches"]
        dropped = sum(r["dropped"] for r in runs)
        delivered = _exactly_once(spec, np.array([p for r in runs for p in r["pieces"]], np.int64))
        assert runs[0]["whole"] == whole == delivered + dropped == sum(r["delivered"] for r in runs) + dropped
        assert dropped == runs[0]["plan_dropped"] <= runs[0]["bound"]
        figures[cuts] = dropped
    step = 2 * 2 * 64
    assert figures["records"] > 4 * step  # whole documents' worth
    assert figures["tokens"] <= 2 * 2 * 4  # the last step padded: two tokens per stream and worker at most
    print(f"torchrun 2 ranks x 2 workers, {whole:,} tokens: dropped {figures['records']:,} "
          f"({figures['records'] / whole:.3%}) with record cuts, {figures['tokens']:,} "
          f"({figures['tokens'] / whole:.3%}) with token cuts")


@pytest.mark.parametrize("world,per_rank", [(2, 1), (4, 3), (8, 8)])
def test_shared_token_cuts_equal_the_plan_alone(world, per_rank):
    """Ranks computing the token cuts together (``planning/shared_cuts.py``) make the plan each
    makes alone, bit for bit, each reading the record indexes of its own cuts only."""
    import threading

    from streamforge.planning.planner import Planner
    from test_plan_fast import _manifest
    from test_plan_shared import _corpus, _Counting, _Share

    streams = _corpus(world * per_rank)
    names = [f"s{i}" for i in range(len(streams))]
    manifests = [_manifest(x) for x in streams]
    spec = CutSpec(world, per_rank, 2, 64)
    kw = dict(world_size=world, workers_per_rank=per_rank, batch_size=2, seq_len=64, packing="concat",
              eos_appended=[True] * len(streams))
    board, barrier = [None] * world, threading.Barrier(world)
    plans, reads = [None] * world, [0] * world

    def planner(sources):
        p = Planner(names, manifests, seed=4, sources=sources.__getitem__)
        p.set_token_cuts(spec, [True] * len(streams))
        return p

    def rank(r):
        sources = [_Counting(x) for x in streams]
        plans[r] = planner(sources).pass_plan(1, share=_Share(r, world, board, barrier), **kw)
        reads[r] = sum(len(set(s.read)) for s in sources)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone_sources = [_Counting(x) for x in streams]
    alone = planner(alone_sources).pass_plan(1, **kw)
    assert alone.cuts is not None and all(p == alone for p in plans)
    assert all(p.to_dict() == alone.to_dict() for p in plans)
    assert max(reads) <= (per_rank + 1) * len(streams)
