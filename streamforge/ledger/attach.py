"""A ledger attached to a loader: where it is kept (``LedgerConfig``) and the writer of the
loader's rank, with the job's meta and the hooks it reads the loader through."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from .store import DEFAULT_CHUNK_STEPS, LedgerWriter


def plan_summary(plan) -> dict[str, Any]:
    """What the ledger keeps of a ``PassPlan``: its steps and token accounting."""
    return {
        "pass": plan.pass_idx, "first_step": plan.first_step, "steps": plan.steps,
        "world_size": plan.world_size, "workers_per_rank": plan.workers_per_rank,
        "batch_size": plan.batch_size, "seq_len": plan.seq_len, "packing": plan.packing,
        "tokens": int(sum(plan.tokens)), "dropped_tokens": plan.dropped_tokens(), "drop_bound": plan.drop_bound(),
    }


@dataclass(frozen=True)
class LedgerConfig:
    """Where a loader keeps its data-order ledger (docs/ledger.md).

    Args:
        url: a local path or any fsspec URL; every rank writes its own files under it.
        storage_options: the storage options of ``url``.
        chunk_steps: steps buffered before a chunk is written (and always before
            ``state_dict()`` returns).
    """

    url: str
    storage_options: dict[str, Any] | None = None
    chunk_steps: int = DEFAULT_CHUNK_STEPS


def for_loader(loader, url: str, storage_options: dict[str, Any] | None = None,
               chunk_steps: int = DEFAULT_CHUNK_STEPS) -> LedgerWriter:
    """The writer of ``loader``'s rank, with the job's meta and hooks into the loader."""
    ds = loader.dataset
    meta = {**loader.config, "stream_urls": [s.url for s in ds.streams]}
    owner = weakref.ref(loader)  # no cycle: a dropped loader frees (and flushes) its writer at once

    def describe_pass(pass_idx: int) -> dict:
        live = owner()
        return {} if live is None else {**plan_summary(live.plan()), "remaining": live.clock.rest is not None}

    def damaged() -> list:
        live = owner()
        return [] if live is None else live.skipped()

    return LedgerWriter(url, rank=ds.rank, world_size=ds.world_size, storage_options=storage_options,
                        meta=meta, chunk_steps=chunk_steps, damaged=damaged, describe_pass=describe_pass)
