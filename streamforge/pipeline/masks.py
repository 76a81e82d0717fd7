"""Attention masks for packed rows, from ``doc_ids`` ([B, T], -1 on padding).

Three views of one rule: position i may attend to position j iff j <= i, both are in the
same document piece of the row, and neither is padding.

- ``packed_causal_mask``: dense bool [B, T, T] (small T, or reference).
- ``cu_seqlens``: cumulative piece lengths over the flattened batch, for FlashAttention's
  varlen kernels (each padding run counts as one sequence so the offsets cover B*T tokens;
  its labels are -100, so it never contributes to the loss).
- ``document_block_mask``: a FlexAttention ``BlockMask`` for the same rule.
"""

from __future__ import annotations

import torch


def packed_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, T, T]: True where query i may attend to key j."""
    if doc_ids.dim() == 1:
        doc_ids = doc_ids.unsqueeze(0)
    seq_len = doc_ids.shape[-1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    real = (doc_ids >= 0).unsqueeze(-1) & (doc_ids >= 0).unsqueeze(-2)
    return same & real & causal


def cu_seqlens(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(int32 cumulative sequence lengths over the flattened batch, max sequence length).

    A new sequence starts at every row start and wherever ``doc_ids`` changes.
    """
    if doc_ids.dim() == 1:
        doc_ids = doc_ids.unsqueeze(0)
    rows, seq_len = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    flat = torch.nonzero(starts.reshape(-1), as_tuple=False).squeeze(-1)
    total = torch.tensor([rows * seq_len], device=doc_ids.device)
    bounds = torch.cat([flat, total]).to(torch.int32)
    max_len = int((bounds[1:] - bounds[:-1]).max()) if len(bounds) > 1 else 0
    return bounds, max_len


def document_mask_mod(doc_ids: torch.Tensor):
    """The FlexAttention ``mask_mod`` for document-causal attention over ``doc_ids`` [B, T]."""

    def mask_mod(b, h, q_idx, kv_idx):
        q_doc = doc_ids[b, q_idx]
        return (q_doc == doc_ids[b, kv_idx]) & (q_doc >= 0) & (kv_idx <= q_idx)

    return mask_mod


def document_block_mask(doc_ids: torch.Tensor, *, block_size: int = 128):
    """A FlexAttention ``BlockMask`` equivalent to ``packed_causal_mask(doc_ids)``."""
    from torch.nn.attention.flex_attention import create_block_mask

    if doc_ids.dim() == 1:
        doc_ids = doc_ids.unsqueeze(0)
    rows, seq_len = doc_ids.shape
    return create_block_mask(
        document_mask_mod(doc_ids), B=rows, H=None, Q_LEN=seq_len, KV_LEN=seq_len,
        device=str(doc_ids.device), BLOCK_SIZE=block_size,
    )
