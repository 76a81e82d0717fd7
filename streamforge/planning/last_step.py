"""The padded last step of a finite token-cut pass (``token_cuts.CutSpec.budgets``).

A pass cut at token positions has ``S`` full steps and then one more, step ``S``, for what no
full step can take (less than one global step): its owners, logical worker ``S % W`` of every
rank, get that rest in about equal shares on top of their full batches, pack it as usual and
end their last batch in padding (``pipeline/batch.py``: pad ids, doc id -1, labels -100), so
every rank keeps the static batch shape and the same step count. A worker then delivers its
tokens up to its batches' capacity: what it holds past that (the two tokens a stream every
busy worker gets for the cut's rounding) is what the pass drops, and what its batches hold
short of it is padding.
"""

from __future__ import annotations

from typing import Any


def _capacities(plan: Any) -> list[int]:
    """Each global worker's batches' tokens in ``plan`` (one batch size and row length)."""
    w, per_batch = plan.workers_per_rank, plan.batch_size * plan.seq_len
    return [plan.batches_of(g % w) * per_batch for g in range(plan.num_global_workers)]


def padded_dropped(plan: Any) -> int:
    """Tokens the workers hold past their batches' capacity (all ranks)."""
    return sum(max(0, int(t) - c) for t, c in zip(plan.tokens, _capacities(plan)))


def padding_tokens(plan: Any, rank: int | None = None) -> int:
    """Padding positions of the pass's batches (all ranks, or ``rank``'s): the capacity its
    workers' tokens do not fill, the padded last step's (0 for a plan without one)."""
    if getattr(plan, "last_step", None) != "pad":
        return 0
    w = plan.workers_per_rank
    pairs = list(zip(plan.tokens, _capacities(plan)))
    if rank is not None:
        pairs = pairs[rank * w : (rank + 1) * w]
    return sum(max(0, c - int(t)) for t, c in pairs)


def padded_bound(plan: Any) -> int:
    """The most a token-cut pass with a padded last step drops: two tokens per stream and
    global worker (``docs/design.md``)."""
    return 2 * len(plan.streams) * plan.num_global_workers
