"""Tiny real corpora and helpers shared by the pipeline tests."""

from __future__ import annotations

import collections

import numpy as np
import torch

from streamforge import PackedTokenDataset, ShardWriter, Stream, StreamingLoader

EOS = 0


def write_stream(url, docs, *, shard_size="8KiB", frame_size="2KiB", storage_options=None, eos_id=EOS):
    with ShardWriter(url, shard_size=shard_size, frame_size=frame_size, eos_id=eos_id,
                     storage_options=storage_options) as writer:
        for doc in docs:
            writer.write(doc)
    return docs


def random_docs(rng, n, median, vocab=1000, sigma=1.0, min_len=0):
    lengths = np.maximum(min_len, rng.lognormal(np.log(median), sigma, size=n).astype(int))
    # token 0 is EOS; documents never contain it
    return [rng.integers(1, vocab, size=int(k)).astype(np.uint16) for k in lengths]


def make_corpus(tmp_path, rng, spec=(("web", 300, 60), ("code", 80, 200), ("books", 20, 700))):
    """Several streams of different document lengths; returns {name: (url, docs)}."""
    out = {}
    for name, n, median in spec:
        url = str(tmp_path / name)
        out[name] = (url, write_stream(url, random_docs(rng, n, median)))
    return out


def dataset(corpus, weights=None, **kwargs):
    names = list(corpus)
    weights = weights or [1.0] * len(names)
    streams = [Stream(corpus[n][0], weight=w, name=n) for n, w in zip(names, weights)]
    kwargs.setdefault("seq_len", 64)
    kwargs.setdefault("shuffle_buffer", 32)
    kwargs.setdefault("shuffle_warmup", 4)  # windows of 4, 8, 16, then 32 documents in every pass
    return PackedTokenDataset(streams, **kwargs)


def take(loader, n=None):
    out = []
    for batch in loader:
        out.append({k: v.clone() for k, v in batch.items()})
        if n is not None and len(out) >= n:
            break
    return out


def assert_batches_equal(got, want):
    assert len(got) == len(want), f"{len(got)} batches, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"batch {i}: {key} differs"


def loader(ds, **kwargs):
    kwargs.setdefault("batch_size", 2)
    return StreamingLoader(ds, **kwargs)


def run_pieces(loaders, steps=None) -> list:
    """Every rank of ``loaders`` (provenance on) iterated to global step ``steps`` (default:
    the end of the pass), in turn: per batch, the array of its pieces' rows ``(stream, shard,
    record, token_start, length)``."""
    pieces = []
    for ld in loaders:
        for batch in batches_to(ld, steps):
            seg = batch["segments"].reshape(-1, 5)
            pieces.append(seg[seg[:, 0] >= 0].numpy())
    return pieces


def batches_to(ld, steps=None):
    """The batches of one iteration of ``ld`` until its global step reaches ``steps`` (default:
    the end of the pass); the iteration is closed after."""
    it = iter(ld)
    try:
        while steps is None or ld.step < steps:
            try:
                yield next(it)
            except StopIteration:
                return
    finally:
        it.close()


def delivered_spans(pieces) -> dict[tuple, list[tuple[int, int]]]:
    """``(stream, shard, record) -> [(start, stop), ...]`` (sorted) of ``pieces``, rows of
    ``(stream, shard, record, token_start, length)``; asserts that no token comes twice."""
    seen: dict[tuple, list] = collections.defaultdict(list)
    for stream, shard, record, start, length in pieces:
        seen[stream, shard, record].append((start, start + length))
    for key, spans in seen.items():
        spans.sort()
        for (_, b0), (a1, _) in zip(spans, spans[1:]):
            assert b0 <= a1, f"{key}: tokens {a1}..{b0} delivered twice"
    return seen


def delivered_tokens(pieces) -> int:
    """Tokens ``pieces`` deliver (``delivered_spans``: none twice)."""
    return sum(b - a for spans in delivered_spans(pieces).values() for a, b in spans)
