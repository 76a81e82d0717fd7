"""What the loader says about a pass before its first batch: a pass with no step, a finite
pass that drops more than 1% of its tokens (``DropWarning``), a mixture it cannot honour
(``mixture.py``), each naming what to change; the pass's drop and padding figures
``stats()`` reports; and the reads a fresh pass starts beside its plan (``start_pass``).

Kept apart from ``loader.py`` (a module under 500 lines); ``StreamingLoader.__iter__`` calls
``start_pass`` (which warns where an iteration would yield no batch) and ``warn_before_pass``
before every iteration.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import DropWarning
from ..planning.last_step import padding_tokens
from . import mixture

DROP_WARN_SHARE = 0.01  # a finite pass dropping more than this share of its tokens is warned of


def warn_empty_pass(loader: Any) -> None:
    """Warn that the loader's pass has 0 steps, with the figures that explain why: the
    rank's tokens, its workers, the next step's batch size and row length."""
    plan, dataset = loader.plan(), loader.dataset
    warnings.warn(
        f"streamforge: pass {loader.clock.pass_idx} has 0 steps, so this iteration yields no batch: rank "
        f"{dataset.rank}'s share of the pass, {plan.rank_tokens(dataset.rank):,} tokens over "
        f"{loader.num_logical} worker(s), cannot fill one full batch of {loader.batch_size} row(s) x seq_len "
        f"{loader.seq_len} on every worker of the {dataset.world_size} rank(s); use a smaller batch_size "
        "or seq_len, fewer ranks or workers, or infinite=True",
        stacklevel=4,
    )


def pass_drop(plan: Any, rank: int) -> dict[str, Any]:
    """``stats()``'s figures of the current finite pass (the next one once a pass is over):
    the tokens its plan drops (all ranks) and their share of the pass, and the padding of its
    last step on this rank (token cuts). ``stats()["padding_tokens"]`` counts the padding
    the workers built."""
    whole = sum(plan.tokens) + sum(plan.unassigned or ())
    dropped = plan.dropped_tokens()
    return {"pass_dropped_tokens": dropped, "pass_dropped_share": dropped / whole if whole else 0.0,
            "pass_padding_tokens": padding_tokens(plan, rank)}


def warn_before_pass(loader: Any) -> None:
    """The warnings due before a pass's first batch: ``MixtureWarning`` (once per pass), then
    ``DropWarning`` (once per loader; concat packing, where the plan's figure is exact and
    token cuts apply: bestfit and pad rows drop by design what they pad or truncate)."""
    mixture.warn_before_pass(loader, stacklevel=4)
    dataset = loader.dataset
    if (not loader.infinite and not loader.evaluation and loader.clock.batch == 0
            and getattr(dataset.config, "cuts", "records") == "records" and dataset.config.packing == "concat"
            and not loader.__dict__.get("_drop_warned")):
        plan = loader.plan()
        figures = pass_drop(plan, dataset.rank)
        if plan.steps > 0 and figures["pass_dropped_share"] > DROP_WARN_SHARE:  # (no step: warn_empty_pass)
            loader._drop_warned = True
            warnings.warn(
                f"streamforge: finite pass {loader.clock.pass_idx} drops {figures['pass_dropped_tokens']:,} tokens, "
                f"{figures['pass_dropped_share']:.2%} of the pass (over all ranks): with record cuts a pass ends "
                "at the steps its lightest worker fills, and what heavier workers hold past it is never "
                "delivered (stats()['pass_dropped_share']); cuts='tokens' cuts the pass inside documents "
                "and delivers every token, or use infinite=True",
                DropWarning, stacklevel=4,
            )


def start_pass(loader: Any) -> None:
    """Before an iteration's first batch: compute the plan (the ranks together) and warn where
    the iteration starts a finite pass that has no step (``warn_empty_pass``). Before the plan,
    at the start of a pass from its first record (no state loaded, nothing handed out yet), on
    the rank whose first batch global worker 0 builds, the reads that batch starts with go out
    (``PackedTokenDataset.start_first_reads``): beside the plan's index reads, not after."""
    clock, dataset = loader.clock, loader.dataset
    if not (loader.evaluation or clock.batch != 0 or clock.rest is not None or dataset.rank != 0
            or any(state is not None for state in clock.worker_states)
            or (loader.shares_reads and dataset.topology.replica > 0)):
        dataset.start_first_reads(clock.pass_idx)
    if not loader.infinite and not loader.evaluation and clock.batch == 0 and loader.plan(share=True).steps == 0:
        warn_empty_pass(loader)
