"""Wrappers that would reshard a ``PackedTokenDataset`` behind its back, refused.

Every rank's ``PackedTokenDataset`` already reads its own share of the corpus (the plan splits
it over the data-parallel ranks, and within a rank over DataLoader workers). A framework that
shards an ``IterableDataset`` again loses data without a word:

* Hugging Face accelerate's ``prepare()`` of a ``DataLoader`` over it either dispatches
  (``DataLoaderDispatcher``: process 0 iterates and splits its batches among the processes, so
  only rank 0's share is ever read) or shards (``IterableDatasetShard``: every process keeps
  one batch in N of what it reads, dropping the rest).

``refuse_foreign_sharding`` finds such a wrapper around the dataset when an iterator over it
starts (in the process or DataLoader worker that iterates), and raises ``ConfigError`` saying
what to do instead. It looks only when accelerate's data loader module is imported, once per
iterator.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

from ..errors import ConfigError

_ACCELERATE = "accelerate.data_loader"
_WRAPPERS = ("DataLoaderDispatcher", "DataLoaderShard", "IterableDatasetShard")


def refuse_foreign_sharding(dataset: Any) -> None:
    """``ConfigError`` if accelerate's ``prepare()`` wrapped a DataLoader over ``dataset``."""
    module = sys.modules.get(_ACCELERATE)
    if module is None:
        return
    kinds = tuple(k for k in (getattr(module, name, None) for name in _WRAPPERS) if isinstance(k, type))
    for obj in gc.get_objects():
        if issubclass(type(obj), kinds) and _wraps(obj, dataset):  # type(): no __class__ lookups
            raise ConfigError(
                f"a PackedTokenDataset is inside a DataLoader that accelerate's prepare() wrapped "
                f"({type(obj).__name__}): accelerate would shard it again, and "
                + ("only rank 0's share would be read, split among the processes"
                   if type(obj).__name__ == "DataLoaderDispatcher" else
                   "every process would drop all but one batch in N of its own share")
                + ". Every rank already reads its own share: use StreamingLoader, and register it for "
                "checkpointing with streamforge.integrations.accelerate.prepare(accelerator, loader) "
                "(docs/integrations.md); or pass the DataLoader to the training loop unprepared")


def _wraps(obj: Any, dataset: Any) -> bool:
    inner = getattr(obj, "dataset", None)
    base = getattr(obj, "__dict__", {}).get("base_dataloader")
    candidates = [inner, getattr(inner, "dataset", None), getattr(base, "dataset", None),
                  getattr(getattr(base, "dataset", None), "dataset", None)]
    return any(c is dataset for c in candidates)
