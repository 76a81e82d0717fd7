"""PyTorch Lightning: a ``StreamingLoader`` whose resume stays exact behind Lightning's fit loop.

Lightning saves a loader's ``state_dict()`` in its checkpoints and restores it with
``load_state_dict`` on ``fit(ckpt_path=...)``. What it must not do is fetch ahead: a loader
without a length gets a prefetching fetcher that takes one batch before the step that trains
the previous one, so a checkpoint would hold the state after a batch that was fetched, not
trained, and the resumed run would skip it. A loader with a length is fetched one batch per
step, with no look-ahead.

* A finite ``StreamingLoader`` has a length (``steps_per_pass``): return it from
  ``train_dataloader()`` as it is.
* An infinite one has no natural length. ``LightningLoader`` gives it one: Lightning's epochs
  become slices of ``steps_per_pass`` steps of the endless stream (one pass of every stream's
  worth), each one iterating the loader on from where the last stopped. The data order, the
  job clock and the state are the loader's, unchanged; only the epoch counter Lightning shows
  is the slice's. Train with ``max_steps``.

    def train_dataloader(self):
        return LightningLoader(StreamingLoader(self.dataset, batch_size=8, num_workers=2))

The dataset may be built in the DataModule's ``__init__``, before the process group exists:
the loader binds it to the group's ranks when iteration starts (``Topology.checked``).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

from ..loader.loader import StreamingLoader


class LightningLoader:
    """A ``StreamingLoader`` with a length in every mode, so that Lightning never fetches ahead.

    Args:
        loader: the loader; its batches, state and clock are used as they are.
    """

    def __init__(self, loader: StreamingLoader) -> None:
        if not isinstance(loader, StreamingLoader):
            raise TypeError(f"LightningLoader wraps a StreamingLoader, got {type(loader).__name__}")
        self.loader = loader

    def __len__(self) -> int:
        """The steps of one pass: a finite loader's pass; an infinite loader's slice (at least 1)."""
        return max(1, self.loader.steps_per_pass) if self.loader.infinite else len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.loader.infinite:
            yield from self.loader
            return
        batches = iter(self.loader)
        try:
            yield from itertools.islice(batches, len(self))
        finally:
            batches.close()  # the slice's end: the next one iterates on from the clock

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:  # step, stats(), resume_report...: the loader's
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
