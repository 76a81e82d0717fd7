"""The three mask helpers agree with each other on real packed batches."""

import numpy as np
import pytest
import torch

from helpers.pipeline import dataset, loader, make_corpus, take
from streamforge import cu_seqlens, document_block_mask, packed_causal_mask
from streamforge.pipeline.masks import document_mask_mod


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    corpus = make_corpus(tmp_path_factory.mktemp("m"), np.random.default_rng(5))
    out = []
    for packing in ("concat", "bestfit"):
        out += take(loader(dataset(corpus, seq_len=128, packing=packing), batch_size=3), 4)
    return out


def _mask_from_cu_seqlens(doc_ids):
    rows, seq_len = doc_ids.shape
    bounds, max_len = cu_seqlens(doc_ids)
    dense = torch.zeros(rows * seq_len, rows * seq_len, dtype=torch.bool)
    lengths = bounds[1:] - bounds[:-1]
    assert int(lengths.max()) == max_len and int(bounds[-1]) == rows * seq_len
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        dense[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    real = (doc_ids >= 0).reshape(-1)
    dense &= real[:, None] & real[None, :]
    # per-row blocks of the flattened varlen mask
    return torch.stack([dense[b * seq_len:(b + 1) * seq_len, b * seq_len:(b + 1) * seq_len] for b in range(rows)])


def test_dense_mask_matches_cu_seqlens(batches):
    for batch in batches:
        doc_ids = batch["doc_ids"]
        assert torch.equal(packed_causal_mask(doc_ids), _mask_from_cu_seqlens(doc_ids))


def test_dense_mask_matches_flex_attention(batches):
    from torch.nn.attention.flex_attention import create_mask

    for batch in batches:
        doc_ids = batch["doc_ids"]
        rows, seq_len = doc_ids.shape
        dense = create_mask(document_mask_mod(doc_ids), rows, 1, seq_len, seq_len, device="cpu")[:, 0]
        assert torch.equal(dense, packed_causal_mask(doc_ids))
        block = document_block_mask(doc_ids, block_size=32)
        blocks = block.to_dense()[:, 0].bool()  # [B, T/32, T/32] block occupancy
        need = dense.reshape(rows, seq_len // 32, 32, seq_len // 32, 32).any(-1).any(-2)
        assert not (need & ~blocks).any(), "a needed block is missing from the BlockMask"


def test_mask_blocks_other_documents_and_padding(batches):
    batch = batches[-1]
    mask = packed_causal_mask(batch["doc_ids"])
    doc_ids = batch["doc_ids"]
    b, i = 0, int(doc_ids.shape[1]) - 1
    assert mask[b, i, : i + 1].sum() == (doc_ids[b, : i + 1] == doc_ids[b, i]).sum() if doc_ids[b, i] >= 0 else True
    assert not mask[doc_ids < 0].any()
