"""What the loader says when a pass has no step: the warning, naming what to change.

Kept apart from ``loader.py`` (a module under 500 lines); ``StreamingLoader.__iter__`` calls
``warn_empty_pass`` before an iteration that would yield no batch.
"""

from __future__ import annotations

import warnings
from typing import Any


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
        stacklevel=3,
    )
