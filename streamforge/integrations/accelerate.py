"""Hugging Face accelerate: a ``StreamingLoader`` saved and restored by ``save_state`` and
``load_state``.

``accelerator.prepare(loader)`` hands a ``StreamingLoader`` back unchanged (it is not a torch
``DataLoader``), which is right: every rank's loader already reads its own share and puts its
batches on the rank's device. What ``prepare`` does not do is checkpoint it: accelerate saves
only the objects it prepared or was told about, so without registration ``save_state`` leaves
the loader out and a resume replays the pass from its start. ``prepare`` here does both:

    loader = streamforge.integrations.accelerate.prepare(accelerator, StreamingLoader(dataset, batch_size=8))
    ...
    accelerator.save_state("ckpt")   # the loader's state, the same on every rank, with the rest
    accelerator.load_state("ckpt")   # the next batches are the uninterrupted run's

A ``DataLoader`` over a ``PackedTokenDataset`` passed to ``accelerator.prepare`` would be
sharded a second time; the dataset refuses it with a ``ConfigError`` when iterated
(``pipeline/foreign.py``).
"""

from __future__ import annotations

from typing import Any

from ..loader.loader import StreamingLoader


def prepare(accelerator: Any, loader: StreamingLoader) -> StreamingLoader:
    """``loader``, registered with ``accelerator`` for checkpointing (once)."""
    if not isinstance(loader, StreamingLoader):
        raise TypeError(f"prepare() takes a StreamingLoader, got {type(loader).__name__}")
    if not any(obj is loader for obj in getattr(accelerator, "_custom_objects", [])):
        accelerator.register_for_checkpointing(loader)
    return loader
