"""What ``StreamingLoader.stats()`` reports, assembled from the loader's parts: its counters,
the clock, the pass's mixture estimate, the storage counters of its workers and its place
among replicas. Kept apart from ``loader.py`` (a module under 500 lines)."""

from __future__ import annotations

from typing import Any

from ..pipeline import core
from . import mixture
from .counters import step_cost, storage_totals
from .passes import pass_drop


def loader_stats(loader: Any) -> dict[str, Any]:
    """``loader.stats()`` (see its docstring)."""
    loader._collect_live_stats()
    out = loader.counters.report(loader.step)
    out.update({"pass": loader.clock.pass_idx, "batch": loader.clock.batch, "skip_steps": loader.skip_steps.to_list()})
    out["batch_size"], out["seq_len"] = loader.batch_size, loader.seq_len  # the next step's (by step)
    # the attention cost of the batch last handed out (pipeline/cost.py), at the step before this one
    out["step_cost"] = step_cost(loader.counters.last, loader.step - 1)
    out["core"] = core.name()  # the hot loops' path: "compiled" (pipeline/_core.c) or "numpy"
    if not loader.infinite:
        out["steps_per_pass"], out["mixture"] = loader.steps_per_pass, mixture.report(loader)
        if not loader.evaluation:  # (an evaluation pass reads everything: its plan is another kind)
            out.update(pass_drop(loader.plan(), loader.dataset.rank))
    head = [loader._head.stats] if loader._head is not None else []
    storage = storage_totals([*loader._stats.values(), *head])
    for name in loader.dataset.stream_names:
        out["streams"][name].update(storage.pop(name, {}))
    out.update(storage)
    topology = loader.dataset.topology
    if topology.replicas > 1:
        out["replica"] = {"index": topology.replica, "of": topology.replicas,
                          "reads_storage": topology.replica == 0 or not loader.read_once}
    return out

