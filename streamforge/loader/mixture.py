"""The loader's view of its mixture: the LR scale of the next step, and whether a finite
pass can honour the weights (``planning/shortfall.py``), warned before the pass's first
batch and reported by ``stats()["mixture"]``."""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import MixtureWarning
from ..planning.shortfall import describe, estimate


def worker_tokens(dataset, plan) -> list[list[int]]:
    """``[g][s]``: global worker ``g``'s tokens of stream ``s`` in ``plan`` (its ranges,
    EOS appended included, and its saved windows' rests after an elastic resume): the
    plan's own counts where it has them (no record index read: a shared plan's ranks hold
    only their own cuts' indexes), else counted from the indexes."""
    if plan.stream_tokens is not None and plan.windows is None:
        return plan.stream_tokens
    n = plan.num_global_workers
    out = [[0] * len(plan.ranges) for _ in range(n)]
    for s, per_worker in enumerate(plan.ranges):
        eos = dataset.eos_appended[s]
        for g in range(n):
            tokens, docs = dataset.planner.totals(s, per_worker[g])
            out[g][s] = tokens + (docs if eos else 0)
            if plan.windows is not None:
                out[g][s] += sum(int(u["tokens"]) for u in plan.windows[s][g])
    return out


def report(loader) -> dict[str, Any] | None:
    """The estimate for the loader's current pass (None: infinite, evaluation, one stream)."""
    dataset = loader.dataset
    if loader.infinite or loader.evaluation or len(dataset.streams) < 2:
        return None
    plan = loader.plan()
    cached = getattr(loader, "_mixture_report", None)
    if cached is not None and cached[0] is plan:
        return cached[1]
    schedule = dataset.schedule
    batch, seq_len = plan.schedules()
    starts = sorted(set(batch.starts) | set(seq_len.starts))
    per_doc = sum(plan.tokens) / sum(plan.rows) if plan.packing == "pad" and sum(plan.rows) else None
    # a batch's tokens by step; in pad packing a row per document: its tokens, at most seq_len
    per_batch = [batch.at(s) * (seq_len.at(s) if per_doc is None else min(seq_len.at(s), per_doc)) for s in starts]
    out = estimate(
        dataset.stream_names, worker_tokens(dataset, plan), starts=schedule.starts, weights=schedule.weights,
        steps=plan.steps, first_step=plan.first_step, workers_per_rank=plan.workers_per_rank,
        tokens_per_batch=(starts, per_batch) if len(starts) > 1 else float(per_batch[0]),
    )
    out["repeats"] = dict(zip(dataset.stream_names, dataset.repeats))
    loader._mixture_report = (plan, out)
    return out


def warn_before_pass(loader, stacklevel: int = 3) -> None:
    """Warn (``MixtureWarning``, once per pass) when the pass cannot honour the weights."""
    out = report(loader)
    if out is None or out["honoured"]:
        return
    warned = loader.__dict__.setdefault("_mixture_warned", set())
    if loader.clock.pass_idx not in warned:
        warned.add(loader.clock.pass_idx)
        warnings.warn(describe(out), MixtureWarning, stacklevel=stacklevel)
