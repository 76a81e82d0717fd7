"""The batch contract (docs/batch.md), checked against the documents as written."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.pipeline import EOS, dataset, loader, take, write_stream
from streamforge.pipeline.batch import FIELDS, IGNORE_INDEX


def _check_batches(batches, docs_by_stream, *, seq_len, packing, boundary):
    """Every contract rule, and token conservation, for a whole pass."""
    seen = {}  # (stream, shard, record) -> list of (token_start, length)
    for batch in batches:
        ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
        doc_ids, src, segs = batch["doc_ids"], batch["source_ids"], batch["segments"]
        assert ids.dtype == labels.dtype == pos.dtype == torch.int64
        assert doc_ids.dtype == src.dtype == torch.int32  # broadcastable by gloo and NCCL
        for b in range(ids.shape[0]):
            t = 0
            for k in range(segs.shape[1]):
                stream, shard, record, token_start, length = segs[b, k].tolist()
                if stream < 0:
                    break
                doc = docs_by_stream[stream][(shard, record)]
                full = np.append(doc, EOS)
                piece = ids[b, t : t + length].numpy()
                assert np.array_equal(piece, full[token_start : token_start + length])
                assert doc_ids[b, t : t + length].eq(k).all()
                assert src[b, t : t + length].eq(stream).all()
                assert torch.equal(pos[b, t : t + length], torch.arange(length))
                # labels: the next token of the same document, else -100 (document boundary)
                want = full[token_start + 1 : token_start + length + 1].astype(np.int64)
                if len(want) < length:  # the piece ends its document
                    if boundary == "document":
                        want = np.append(want, IGNORE_INDEX)
                    else:
                        want = np.append(want, labels[b, t + length - 1].item())
                assert np.array_equal(labels[b, t : t + length].numpy(), want)
                seen.setdefault((stream, shard, record), []).append((token_start, length))
                t += length
            assert (doc_ids[b, t:] == -1).all() and (labels[b, t:] == IGNORE_INDEX).all()
            assert (src[b, t:] == -1).all()
            if packing == "concat":
                assert t == seq_len  # every batch of a finite pass is full
    if boundary == "stream" and batches:  # plain stream packing: labels are the token stream shifted once
        stream = torch.cat([b["input_ids"][b["doc_ids"] >= 0] for b in batches])
        labels = torch.cat([b["labels"][b["doc_ids"] >= 0] for b in batches])
        assert torch.equal(labels[:-1], stream[1:])
    # conservation: no document twice, its pieces contiguous from its start; what a pass
    # drops at its end is counted (checked by the caller)
    expected = {(s, key) for s, docs in docs_by_stream.items() for key, d in docs.items() if len(d)}
    assert {(s, (sh, r)) for s, sh, r in seen} <= expected
    delivered = 0
    for (stream, shard, record), pieces in seen.items():
        full_len = len(docs_by_stream[stream][(shard, record)]) + 1
        covered = 0
        for start, length in sorted(pieces):
            assert start == covered
            covered += length
        assert covered <= (full_len if packing != "pad" else min(full_len, seq_len))
        delivered += covered
    return delivered


def _docs_by_key(url, docs):
    from streamforge import Manifest

    m = Manifest.load(url)
    out, i = {}, 0
    for shard, n in enumerate(m.columns["num_records"].tolist()):
        for r in range(n):
            out[(shard, r)] = docs[i]
            i += 1
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.lists(st.integers(0, 150), min_size=1, max_size=25), min_size=1, max_size=3),
    seq_len=st.integers(4, 64),
    packing=st.sampled_from(["concat", "bestfit", "pad"]),
    boundary=st.sampled_from(["document", "stream"]),
    batch_size=st.integers(1, 3),
    seed=st.integers(0, 100),
)
def test_contract_and_conservation(tmp_path_factory, lengths, seq_len, packing, boundary, batch_size, seed):
    if packing != "concat" and boundary == "stream":
        boundary = "document"  # stream boundary is plain stream packing: concat only
    rng = np.random.default_rng(seed)
    tmp = tmp_path_factory.mktemp("c")
    corpus, docs_by_stream = {}, {}
    for i, lens in enumerate(lengths):
        if sum(lens) == 0:
            lens = lens + [3]
        docs = [rng.integers(1, 500, size=n).astype(np.uint16) for n in lens]
        url = str(tmp / f"s{i}")
        write_stream(url, docs, shard_size="1KiB", frame_size="512B")
        corpus[f"s{i}"] = (url, docs)
        docs_by_stream[i] = _docs_by_key(url, docs)
    ds = dataset(corpus, weights=[1.0 + i for i in range(len(corpus))], seq_len=seq_len, shuffle_buffer=7,
                 packing=packing, boundary=boundary, provenance=True, bestfit_window=5, seed=seed)
    ldr = loader(ds, batch_size=batch_size)
    plan = ldr.plan()
    batches = take(ldr)
    assert len(batches) == plan.steps
    assert all(b["input_ids"].shape == (batch_size, seq_len) for b in batches)
    delivered = _check_batches(batches, docs_by_stream, seq_len=seq_len, packing=packing, boundary=boundary)
    total = sum(len(d) + 1 for docs in docs_by_stream.values() for d in docs.values() if len(d))
    dropped = ldr.stats()["dropped_tokens"]
    assert delivered + dropped == total  # token conservation
    if packing == "concat":
        assert dropped == plan.dropped_tokens() <= plan.drop_bound()


def test_bestfit_pads_less_than_pad_and_splits_only_long_documents(tmp_path, rng):
    docs = [rng.integers(1, 500, size=int(n)).astype(np.uint16) for n in rng.integers(1, 120, size=300)]
    url = str(tmp_path / "s")
    write_stream(url, docs)
    corpus = {"s": (url, docs)}
    counts = {}
    for packing in ("bestfit", "pad"):
        batches = take(loader(dataset(corpus, seq_len=128, packing=packing, provenance=True), batch_size=4))
        counts[packing] = sum(int((b["doc_ids"] < 0).sum()) for b in batches)
        segs = torch.cat([b["segments"].reshape(-1, 5) for b in batches])
        segs = segs[segs[:, 0] >= 0]
        assert (segs[:, 3] == 0).all()  # no document shorter than a row is split
    assert counts["bestfit"] < counts["pad"] / 3


def test_documents_with_eos_get_no_second_eos(tmp_path, rng):
    from streamforge import ShardWriter

    docs = [np.append(rng.integers(10, 100, size=int(n)), 7).astype(np.uint16) for n in rng.integers(1, 30, size=20)]
    url = str(tmp_path / "s")
    with ShardWriter(url, eos_id=7, docs_end_with_eos=True, shard_size="1KiB") as w:
        for d in docs:
            w.write(d)
    ldr = loader(dataset({"s": (url, docs)}, seq_len=16), batch_size=2)
    batches = take(ldr)
    flat = torch.cat([b["input_ids"][b["doc_ids"] >= 0] for b in batches])
    assert not bool(((flat[1:] == 7) & (flat[:-1] == 7)).any())
    assert len(flat) + ldr.stats()["dropped_tokens"] == sum(len(d) for d in docs)


def test_missing_eos_id_is_a_clear_error(tmp_path, rng):
    from streamforge import ConfigError, PackedTokenDataset, ShardWriter

    url = str(tmp_path / "s")
    with ShardWriter(url) as w:
        w.write(np.arange(1, 10))
    with pytest.raises(ConfigError, match="eos_id"):
        PackedTokenDataset(url, seq_len=8)


@pytest.mark.parametrize("packing", ["concat", "bestfit"])
@pytest.mark.parametrize("fields", [("input_ids", "labels"), ("position_ids", "labels", "input_ids"),
                                    ("doc_ids",), ("source_ids", "doc_ids")])
def test_a_loader_hands_out_only_the_fields_asked_for(tmp_path, rng, packing, fields):
    """Asked-for fields equal the full contract's, on padded (bestfit) and full batches, in
    both boundary modes, and the data order and state do not depend on them."""
    from helpers.pipeline import make_corpus

    corpus = make_corpus(tmp_path, rng)
    for boundary in ("document", "stream"):
        full_loader = loader(dataset(corpus, packing=packing, boundary=boundary, seed=5), num_workers=0)
        some_loader = loader(dataset(corpus, packing=packing, boundary=boundary, seed=5), num_workers=0,
                             fields=fields)
        full, some = take(full_loader, 12), take(some_loader, 12)
        assert len(full) == len(some) == 12
        for a, b in zip(full, some):
            assert list(b) == [f for f in FIELDS if f in fields]  # in the contract's order
            for name in fields:
                assert torch.equal(a[name], b[name]) and a[name].dtype == b[name].dtype
        assert full_loader.state_dict() == some_loader.state_dict()


def test_unknown_fields_are_a_clear_error(tmp_path, rng):
    from helpers.pipeline import make_corpus

    from streamforge.errors import ConfigError

    ds = dataset(make_corpus(tmp_path, rng))
    with pytest.raises(ConfigError, match="'attention_mask' unknown"):
        loader(ds, fields=["input_ids", "attention_mask"])



def test_a_rank_that_asks_for_no_field_keeps_the_clock_and_the_state(tmp_path, rng):
    """A middle pipeline stage: empty batches, the same steps and state as a rank with every field."""
    from helpers.pipeline import make_corpus

    ds = dataset(make_corpus(tmp_path, rng))
    full, none = loader(ds), loader(ds, fields=())
    got = [(full.step, b) for b in itertools.islice(full, 5)]
    empty = [(none.step, b) for b in itertools.islice(none, 5)]
    assert [s for s, _ in got] == [s for s, _ in empty] == list(range(1, 6))  # the step after each batch
    assert all(b == {} for _, b in empty)
    assert none.state_dict() == full.state_dict()


def test_a_finite_loader_has_its_passes_steps_as_length_and_an_infinite_one_none(tmp_path, rng):
    """Frameworks read a loader's length to know a pass's end without fetching ahead."""
    from helpers.pipeline import make_corpus

    corpus = make_corpus(tmp_path, rng)
    finite = loader(dataset(corpus))
    assert len(finite) == finite.steps_per_pass > 0 and len(list(finite)) == len(finite)
    endless = loader(dataset(corpus, infinite=True))
    with pytest.raises(TypeError, match="an infinite StreamingLoader has no length"):
        len(endless)
    assert bool(endless) and bool(finite)
