"""Loss per stream, exact across ranks.

``StreamLoss`` accumulates, per stream, the sum of per-token losses and the number of tokens
that have a label (``labels != -100``), keyed by the batch's ``source_ids``. ``compute``
all-reduces the sums and counts (not the means), so the result is the loss over every token
the job saw, whatever the number of ranks: with an evaluation loader (``docs/eval.md``) it is
a property of the model and the held-out set alone.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from .batch import IGNORE_INDEX

OVERALL = "all"


class StreamLoss:
    """Mean loss per stream and overall.

    ``names`` are the stream names in stream order (``dataset.stream_names``); a dataset or
    loader is accepted too. Typical use::

        per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                    reduction="none")   # ignore_index -100 gives 0 there
        metric.update(per_token, batch)
        ...
        metric.compute()   # {"web": 2.91, "code": 1.78, "all": 2.47}; every rank must call it

    Sums are kept in float64 on the device of the first loss seen.

    Args:
        names: the stream names in stream order, or a dataset or loader to take them from;
            none may be ``"all"``, which names the overall mean.
    """

    def __init__(self, names: Sequence[str] | Any) -> None:
        if hasattr(names, "dataset"):
            names = names.dataset
        if hasattr(names, "stream_names"):
            names = names.stream_names
        self.names = [str(n) for n in names]
        if OVERALL in self.names:
            raise ValueError(f"a stream may not be called {OVERALL!r}: it names the overall mean")
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def reset(self) -> None:
        self.sums = self.counts = None

    def update(self, per_token_loss: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> None:
        """Add a batch: ``per_token_loss`` has the shape of ``batch["labels"]`` (or is its
        flattening); positions whose label is -100 do not count."""
        labels = batch["labels"].reshape(-1)
        source = batch["source_ids"].reshape(-1).to(labels.device)
        loss = per_token_loss.detach().reshape(-1)
        if loss.numel() != labels.numel():
            raise ValueError(f"per-token loss has {loss.numel()} values, the batch {labels.numel()} labels")
        keep = (labels != IGNORE_INDEX) & (source >= 0)
        source = source[keep].long()
        n = len(self.names)
        if self.sums is None:
            self.sums = torch.zeros(n, dtype=torch.float64, device=loss.device)
            self.counts = torch.zeros(n, dtype=torch.float64, device=loss.device)
        self.sums.index_add_(0, source.to(loss.device), loss[keep.to(loss.device)].double())
        self.counts.index_add_(0, source.to(loss.device), torch.ones_like(source, dtype=torch.float64, device=loss.device))

    def totals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of losses, token count) per stream, summed over ranks when a process group
        exists (a collective: every rank calls it)."""
        n = len(self.names)
        sums = self.sums if self.sums is not None else torch.zeros(n, dtype=torch.float64)
        counts = self.counts if self.counts is not None else torch.zeros(n, dtype=torch.float64)
        both = torch.stack([sums, counts.to(sums.device)])
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl" and both.device.type != "cuda":
                both = both.cuda()
            both = both.clone()
            dist.all_reduce(both)
        return both[0].cpu(), both[1].cpu()

    def compute(self) -> dict[str, float]:
        """``{stream: mean loss, ..., "all": mean over every counted token}`` (nan where no
        token counted)."""
        sums, counts = self.totals()
        out = {name: _mean(float(s), float(c)) for name, s, c in zip(self.names, sums, counts)}
        out[OVERALL] = _mean(float(sums.sum()), float(counts.sum()))
        return out


def _mean(total: float, count: float) -> float:
    return total / count if count else math.nan
