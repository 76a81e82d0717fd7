"""Batch size and sequence length by step (planning/steps.py): validation, the plan's step
count, batch shapes exactly at their steps, and every token once across a switch in every
packing mode (real tar/zstd shards, in process and in DataLoader workers)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.pipeline import dataset, make_corpus, write_stream
from streamforge import ConfigError, EvaluationDataset, PackedTokenDataset, Stream, StreamingLoader
from streamforge.pipeline.batch import IGNORE_INDEX
from streamforge.planning.plan import PassPlan, steps_for
from streamforge.planning.steps import StepSchedule, batch_schedule, step_at_tokens, tokens_in_steps

BATCHES = [(0, 2), (5, 3), (9, 4)]
SEQ_LENS = [(0, 24), (7, 40)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("steps"), np.random.default_rng(40),
                       spec=(("web", 80, 60), ("code", 40, 150)))


# -- validation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value,match", [
    ([], r"batch_size is an empty schedule"),
    ([(1, 2)], r"batch_size\[0\] must start at step 0, got step 1"),
    ([(0, 2), (5, 3), (5, 4)], r"batch_size\[2\] starts at step 5, not after batch_size\[1\] \(step 5\)"),
    ([(0, 2), (5, 3), (4, 4)], r"batch_size\[2\] starts at step 4, not after batch_size\[1\] \(step 5\)"),
    ([(0, 2), (5, 0)], r"batch_size\[1\] \(step 5\) has value 0; values are integers >= 1"),
    ([(0, 2), (5, -1)], r"batch_size\[1\] \(step 5\) has value -1"),
    ([(0, 2), (5, 2.5)], r"batch_size\[1\] \(step 5\) has value 2.5"),
    ([(0, 2), (5, True)], r"batch_size\[1\] \(step 5\) has value True"),
    ([(0, 2), (-3, 4)], r"batch_size\[1\] has step -3; steps are integers >= 0"),
    ([(0, 2), (1.5, 4)], r"batch_size\[1\] has step 1.5"),
    ([(0, 2), 7], r"batch_size\[1\] must be a \(step, batch_size\) pair, got 7"),
    ([(0, 2), (3, 4, 5)], r"batch_size\[1\] must be a \(step, batch_size\) pair"),
    (0, r"batch_size must be >= 1, got 0"),
    (2.0, r"batch_size must be an integer, got 2.0"),
    ("4", r"batch_size must be an integer, got '4'"),
])
def test_every_batch_size_schedule_error_names_the_entry(corpus, value, match):
    with pytest.raises(ConfigError, match=match):
        StreamingLoader(dataset(corpus), batch_size=value)


@pytest.mark.parametrize("value,match", [
    ([(0, 16), (4, 0)], r"seq_len\[1\] \(step 4\) has value 0"),
    ([(2, 16)], r"seq_len\[0\] must start at step 0, got step 2"),
    ([(0, 16), (4, 32), (4, 8)], r"seq_len\[2\] starts at step 4, not after seq_len\[1\] \(step 4\)"),
    ([(0, 16), ("4", 8)], r"seq_len\[1\] has step '4'"),
    ([(0, 16), None], r"seq_len\[1\] must be a \(step, seq_len\) pair, got None"),
    ([], r"seq_len is an empty schedule"),
])
def test_every_seq_len_schedule_error_names_the_entry(corpus, value, match):
    with pytest.raises(ConfigError, match=match):
        dataset(corpus, seq_len=value)


def test_tokens_per_step_errors(corpus):
    ds = dataset(corpus, seq_len=SEQ_LENS)
    with pytest.raises(ConfigError, match=r"tokens_per_step 100 is not a multiple of seq_len 24 \(from step 0\)"):
        StreamingLoader(ds, tokens_per_step=100)
    with pytest.raises(ConfigError, match=r"tokens_per_step 72 is not a multiple of seq_len 40 \(from step 7\)"):
        StreamingLoader(ds, tokens_per_step=72)
    with pytest.raises(ConfigError, match=r"tokens_per_step must be an integer >= 1, got 0"):
        StreamingLoader(ds, tokens_per_step=0)
    with pytest.raises(ConfigError, match=r"batch_size 4 at step 0 disagrees with tokens_per_step 240 / seq_len 24"):
        StreamingLoader(ds, tokens_per_step=240, batch_size=4)
    with pytest.raises(ConfigError, match=r"batch_size 10 at step 7 disagrees .* seq_len 40 = 6"):
        StreamingLoader(ds, tokens_per_step=240, batch_size=[(0, 10), (9, 6)])
    with pytest.raises(ConfigError, match=r"needs batch_size= .* or tokens_per_step="):
        StreamingLoader(ds)
    agreed = StreamingLoader(ds, tokens_per_step=240, batch_size=[(0, 10), (7, 6)])
    assert agreed.batch_sizes.describe() == [[0, 10], [7, 6]]


def test_schedules_are_refused_where_no_clock_runs(corpus):
    urls = [url for url, _ in corpus.values()]
    with pytest.raises(ConfigError, match=r"an evaluation dataset has one seq_len"):
        EvaluationDataset(urls, seq_len=SEQ_LENS)
    with pytest.raises(ConfigError, match=r"an evaluation loader has one batch_size"):
        StreamingLoader(EvaluationDataset(urls, seq_len=16), batch_size=BATCHES)
    with pytest.raises(ConfigError, match=r"seq_len schedule runs on the job clock"):
        iter(dataset(corpus, seq_len=SEQ_LENS))


def test_a_schedule_describes_itself_into_the_fingerprint(corpus):
    plain = StreamingLoader(dataset(corpus, seq_len=24), batch_size=2)
    ramp = StreamingLoader(dataset(corpus, seq_len=24), batch_size=BATCHES)
    warm = StreamingLoader(dataset(corpus, seq_len=SEQ_LENS), batch_size=2)
    assert plain.config["batch_size"] == 2 and plain.config["seq_len"] == 24  # as before schedules
    assert ramp.config["batch_size"] == [[0, 2], [5, 3], [9, 4]]
    assert warm.config["seq_len"] == [[0, 24], [7, 40]]
    assert len({plain.fingerprint, ramp.fingerprint, warm.fingerprint}) == 3
    assert StreamingLoader(dataset(corpus, seq_len=24), batch_size=[(0, 2)]).fingerprint == plain.fingerprint


# -- the plan's step count -----------------------------------------------------------------------

def _schedule(name):
    """A random schedule: a value at step 0, then up to four switches at increasing steps."""
    gaps_values = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6)), max_size=4)
    return st.tuples(st.integers(1, 6), gaps_values).map(lambda drawn: StepSchedule.build(name, [(0, drawn[0])] + [
        (int(s), v) for s, (_, v) in zip(np.cumsum([g for g, _ in drawn[1]]), drawn[1])]))


def _cost(batch, seq, packing, step):
    per_token = seq.constant is None and packing != "pad"
    return batch.at(step) * (seq.at(step) if per_token else 1)


def _fits(caps, W, first, batch, seq, packing, S):
    """Every global worker can fill every step of the first S it owns."""
    for g, cap in enumerate(caps):
        w = g % W
        if sum(_cost(batch, seq, packing, first + i) for i in range(w, S, W)) > cap:
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(batch=_schedule("batch_size"), seq=_schedule("seq_len"), packing=st.sampled_from(["concat", "bestfit", "pad"]),
       world=st.integers(1, 3), W=st.integers(1, 4), first=st.integers(0, 60), data=st.data())
def test_the_plan_has_the_most_steps_every_worker_can_fill(batch, seq, packing, world, W, first, data):
    caps = data.draw(st.lists(st.integers(0, 400), min_size=world * W, max_size=world * W))
    S = steps_for(caps, world_size=world, workers_per_rank=W, batch_size=batch, seq_len=seq, packing=packing,
                  first_step=first)
    assert _fits(caps, W, first, batch, seq, packing, S)  # every worker fills every step it owns
    assert not _fits(caps, W, first, batch, seq, packing, S + 1)  # one more would not fit someone


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.integers(0, 500), min_size=1, max_size=8), W=st.integers(1, 4), B=st.integers(1, 9),
       first=st.integers(0, 50))
def test_one_batch_size_gives_the_plan_it_always_gave(rows, W, B, first):
    rows = rows[: len(rows) // W * W] or rows[:1] * W
    want = min(W * (r // B) + g % W for g, r in enumerate(rows))
    assert steps_for(rows, world_size=len(rows) // W, workers_per_rank=W, batch_size=B) == want
    assert steps_for(rows, world_size=len(rows) // W, workers_per_rank=W, batch_size=StepSchedule.build("b", [(0, B)]),
                     seq_len=17, first_step=first) == want


def test_step_tokens_and_their_inverse():
    batch, seq = StepSchedule.build("batch_size", BATCHES), StepSchedule.build("seq_len", SEQ_LENS)
    per = [batch.at(s) * seq.at(s) for s in range(30)]
    for first, count in [(0, 30), (3, 10), (8, 0), (9, 21)]:
        assert tokens_in_steps(batch, seq, first, count) == sum(per[first : first + count])
    for step in range(30):
        assert step_at_tokens(batch, seq, sum(per[:step])) == step
    assert batch_schedule(None, 480, seq).describe() == [[0, 20], [7, 12]]


# -- batches on the clock ------------------------------------------------------------------------

def _batches(loader):
    """Every batch of a pass with the step, ``loader.batch_size`` and ``loader.seq_len`` it had."""
    out = []
    before = (loader.step, loader.batch_size, loader.seq_len)
    for batch in loader:
        out.append((before, {k: v.clone() for k, v in batch.items()}))
        before = (loader.step, loader.batch_size, loader.seq_len)
    return out


def _check_batch_fields(batches):
    """Masks, positions, doc ids and labels of each row: positions count from 0 in each
    document piece of a row, doc ids number the pieces, padding is -1 / -100."""
    for _, b in batches:
        ids, labels, pos, doc = b["input_ids"], b["labels"], b["position_ids"], b["doc_ids"]
        for r in range(ids.shape[0]):
            d = doc[r]
            real = d >= 0
            assert torch.all(labels[r][~real] == IGNORE_INDEX)
            starts = torch.ones_like(real)
            starts[1:] = d[1:] != d[:-1]
            expect, at = torch.zeros_like(pos[r]), 0
            for t in range(len(d)):
                at = 0 if starts[t] else at + 1
                expect[t] = at
            assert torch.equal(pos[r][real], expect[real])
            same_next = real[:-1] & (d[:-1] == d[1:])
            assert torch.equal(labels[r][:-1][same_next], ids[r][1:][same_next])


def _docs_by_key(corpus):
    """Each (stream, shard, record) -> its tokens with EOS, from the shards as written."""
    from streamforge import Manifest

    out = {}
    for s, (url, docs) in enumerate(corpus.values()):
        manifest = Manifest.load(url)
        k = 0
        for shard in range(manifest.num_shards):
            for record in range(int(manifest.columns["num_records"][shard])):
                out[s, shard, record] = np.append(docs[k], 0)
                k += 1
    return out


def _check_pieces(corpus, batches, whole):
    """Every piece's tokens are its document's; no token twice; with ``whole``, every
    document of the pass that was started is delivered to its end (concat, bestfit)."""
    docs = _docs_by_key(corpus)
    spans = collections.defaultdict(list)
    for _, b in batches:
        seg, ids = b["segments"], b["input_ids"]
        for r in range(seg.shape[0]):
            col = 0
            for stream, shard, record, start, length in seg[r].tolist():
                if stream < 0:
                    continue
                doc = docs[stream, shard, record]  # a row's pieces lie end to end from its start
                assert np.array_equal(ids[r, col : col + length].numpy(), doc[start : start + length]), \
                    f"piece {stream, shard, record, start} is not its document's tokens"
                col += length
                spans[stream, shard, record].append((start, start + length))
    for key, got in spans.items():
        got.sort()
        for (a0, b0), (a1, _) in zip(got, got[1:]):
            assert b0 <= a1, f"{key}: tokens {a1}..{b0} delivered twice"
            if whole:
                assert b0 == a1, f"{key}: tokens {b0}..{a1} skipped"
    return spans


@pytest.mark.parametrize("packing", ["concat", "bestfit", "pad"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_batch_has_its_steps_shape_and_every_token_once(corpus, packing, num_workers):
    ds = dataset(corpus, seq_len=SEQ_LENS, packing=packing, provenance=True, bestfit_window=6)
    ld = StreamingLoader(ds, batch_size=BATCHES, num_workers=num_workers)
    assert ld.batch_size == 2 and ld.seq_len == 24
    steps = ld.steps_per_pass
    assert len(ld) == steps
    batches = _batches(ld)
    assert len(batches) == steps > 12
    for i, ((step, rows, seq_len), b) in enumerate(batches):
        assert step == i and rows == dict(BATCHES).get(i, rows) and b["input_ids"].shape == (rows, seq_len)
        assert (rows, seq_len) == (ld.batch_sizes.at(i), ds.seq_lens.at(i))
        assert torch.all(b["doc_ids"][:, 0] == 0)  # full: every row starts with a document
    _check_batch_fields(batches)
    _check_pieces(corpus, batches, whole=packing != "pad")
    assert ld.stats()["padded_rows"] == 0


def test_the_switch_carries_a_document_over_and_shifts_labels_once(corpus):
    """One worker in concat packing: the rows of the pass are the token stream cut in rows of
    24, then of 40 from step 7 on; the document open at the switch goes on in the first row
    of step 7, and the last label of step 6 is that row's first token."""
    ds = dataset(corpus, seq_len=SEQ_LENS, provenance=True)
    batches = _batches(StreamingLoader(ds, batch_size=BATCHES))
    flat_ids = torch.cat([b["input_ids"].reshape(-1) for _, b in batches])
    flat_labels = torch.cat([b["labels"].reshape(-1) for _, b in batches])
    flat_doc = torch.cat([b["doc_ids"].reshape(-1) for _, b in batches])
    shifted = flat_labels[:-1] != IGNORE_INDEX
    assert torch.equal(flat_labels[:-1][shifted], flat_ids[1:][shifted])
    assert torch.all(flat_ids[:-1][~shifted] == 0)  # only a document's EOS has no label
    before, after = batches[6][1], batches[7][1]
    assert before["segments"][-1, :, 0].ge(0).sum() >= 1
    last = before["segments"][-1][before["segments"][-1, :, 0] >= 0][-1].tolist()
    first = after["segments"][0, 0].tolist()
    if last[3] + last[4] < len(_docs_by_key(corpus)[tuple(last[:3])]):  # a document open at the switch
        assert first[:3] == last[:3] and first[3] == last[3] + last[4]
        assert before["labels"][-1, -1] == after["input_ids"][0, 0]
    assert flat_doc.numel() == sum(b["input_ids"].numel() for _, b in batches)


def test_tokens_per_step_keeps_the_tokens_of_a_step(corpus):
    ds = dataset(corpus, seq_len=SEQ_LENS)
    ld = StreamingLoader(ds, tokens_per_step=120)
    assert ld.batch_sizes.describe() == [[0, 5], [7, 3]]
    batches = _batches(ld)
    assert {b["input_ids"].numel() for _, b in batches} == {120}
    assert ld.plan().dropped_tokens() == sum(ld.plan().tokens) - 120 * len(batches)


def test_the_plan_of_a_schedule_round_trips_and_bounds_what_it_drops(corpus):
    ld = StreamingLoader(dataset(corpus, seq_len=SEQ_LENS), batch_size=BATCHES, num_workers=2)
    plan = ld.plan()
    again = PassPlan.from_dict(plan.to_dict())
    assert again == plan and again.schedules() == (ld.batch_sizes, ld.dataset.seq_lens)
    batches = _batches(ld)
    delivered = sum(b["input_ids"].numel() for _, b in batches)
    assert plan.dropped_tokens() == sum(plan.tokens) - delivered <= plan.drop_bound()


def test_a_pass_too_small_for_the_ramp_warns(tmp_path, rng):
    url = str(tmp_path / "tiny")
    write_stream(url, [rng.integers(1, 100, 30).astype(np.uint16) for _ in range(4)])
    ld = StreamingLoader(dataset({"tiny": (url, None)}, seq_len=[(0, 64), (1, 8)]), batch_size=[(0, 4), (1, 1)])
    with pytest.warns(UserWarning, match=r"0 steps.*4 row\(s\) x seq_len 64"):
        assert list(ld) == []


@pytest.mark.parametrize("packing", ["concat", "bestfit", "pad"])
@pytest.mark.parametrize("seq_lens", [[(0, 24), (7, 40)], [(0, 40), (5, 16), (9, 56)]], ids=["longer", "shorter"])
def test_a_pipeline_to_its_end_delivers_every_document_whole_across_switches(corpus, packing, seq_lens):
    """One worker's pipeline, run past its quota to the end of its data: every document of the
    pass comes once, whole (pad: its first seq_len tokens), whatever the switches cut."""
    ds = dataset(corpus, seq_len=seq_lens, packing=packing, provenance=True, bestfit_window=6)
    pipeline = ds.make_pipeline(0, 1)
    from streamforge.pipeline.batch import expand

    batches, relaid = [], False
    while (rows := pipeline.next_batch(3)) is not None:
        step = pipeline.step - 1
        assert rows.seq_len == ds.seq_lens.at(step)
        relaid |= isinstance(pipeline.packer.state_dict()["window"], list) and len(
            pipeline.packer.state_dict()["window"]) > 1
        batches.append((None, expand(rows, provenance=True)))
    pipeline.close()
    assert packing != "bestfit" or relaid  # a switch found a bestfit window with rows left
    spans = _check_pieces(corpus, batches, whole=packing != "pad")
    docs = _docs_by_key(corpus)
    assert set(spans) == set(docs)  # every document of the pass
    for key, got in spans.items():
        end = len(docs[key]) if packing != "pad" else None
        assert got[0][0] == 0 and (end is None or got[-1][1] == end), f"{key}: not whole"


def test_the_ledger_of_a_ramp_checks_clean_and_shows_each_step(corpus, tmp_path):
    from streamforge.ledger.report import check, show
    from streamforge.ledger.store import read_ledger
    from test_ledger import _segments, _shown

    ds = dataset(corpus, seq_len=SEQ_LENS, provenance=True)
    ld = StreamingLoader(ds, batch_size=BATCHES, num_workers=2, ledger_dir=str(tmp_path / "ledger"))
    batches = [b for _, b in _batches(ld)]
    ledger = read_ledger(str(tmp_path / "ledger"))
    report = check(ledger, dict(zip(ds.stream_names, ds.manifests)))
    assert report["ok"], report["problems"]
    (p,) = report["passes"]
    assert p["delivered_tokens"] == sum(int((b["doc_ids"] >= 0).sum()) for b in batches)
    assert p["not_delivered_tokens"] == p["dropped_tokens"] <= p["drop_bound"]
    names = ds.stream_names
    for step in (0, 6, 7, 8, 9, 10, len(batches) - 1):
        want = [(names[s], sh, r, t, n) for s, sh, r, t, n in _segments(batches[step])]
        assert _shown(show(ledger, step)) == want



def test_stats_give_the_next_steps_shape(corpus):
    """``stats()`` holds the batch size and row length of the step about to be trained."""
    ds = PackedTokenDataset([Stream(corpus["web"][0], name="web")], seq_len=[(0, 24), (3, 40)])
    loader = StreamingLoader(ds, batch_size=[(0, 2), (2, 3)])
    seen = [(loader.stats()["batch_size"], loader.stats()["seq_len"])]
    it = iter(loader)
    for _ in range(4):
        next(it)
        stats = loader.stats()
        seen.append((stats["batch_size"], stats["seq_len"]))
    assert seen == [(2, 24), (2, 24), (3, 24), (3, 40), (3, 40)]
