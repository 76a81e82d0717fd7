"""A ledger attached to a loader: where it is kept (``LedgerConfig``) and the writer of the
loader's rank, with the job's meta and the hooks it reads the loader through."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from ..topology import Topology
from .store import DEFAULT_CHUNK_STEPS, LedgerWriter


def plan_summary(plan) -> dict[str, Any]:
    """What the ledger keeps of a ``PassPlan``: its steps and token accounting."""
    return {
        "pass": plan.pass_idx, "first_step": plan.first_step, "steps": plan.steps,
        "world_size": plan.world_size, "workers_per_rank": plan.workers_per_rank,
        "batch_size": plan.batch_size, "seq_len": plan.seq_len, "packing": plan.packing,
        # the pass's tokens, with those token cuts give no worker (``PassPlan.unassigned``)
        "tokens": int(sum(plan.tokens)) + sum(getattr(plan, "unassigned", None) or ()), "dropped_tokens": plan.dropped_tokens(), "drop_bound": plan.drop_bound(),
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


class ReplicaLedger:
    """The ledger of a replica (a tensor, context or pipeline parallel peer past the first):
    replica 0 of its data-parallel rank writes the same steps, so this one writes nothing and
    only joins the ledger's collectives (the generation agreed on at every start)."""

    participant = commits = False
    history = None

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.generation = -1
        self.start_generation(0, "fresh")

    def start_generation(self, resumed_at_step: int, mode: str, scope: str | None = None) -> int:
        self.generation = self.topology.agree_max(-1)  # replica 0's writer brings the number
        return self.generation

    def commit(self, step: int, wait: bool = False) -> None:
        pass

    def replan(self, pass_idx: int) -> None:
        pass

    def add(self, step: int, pass_idx: int, rows: Any, skipped: bool = False) -> None:
        pass

    def flush(self, wait: bool = True) -> None:
        pass


def for_loader(loader, url: str, storage_options: dict[str, Any] | None = None,
               chunk_steps: int = DEFAULT_CHUNK_STEPS) -> LedgerWriter | ReplicaLedger:
    """The writer of ``loader``'s rank, with the job's meta and hooks into the loader (a
    ``ReplicaLedger`` on a replica past the first: one writer per data-parallel rank)."""
    ds = loader.dataset
    if ds.topology.replica > 0:
        return ReplicaLedger(ds.topology)
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
