"""Python's cyclic garbage collector, paused while a pass is set up.

Setting up a pass builds a few Python objects per shard: the manifest's columns, the plan's
record ranges, the read-ahead's copy of a worker's ranges. Over a manifest of 100,000 shards
that is hundreds of thousands of objects in a fraction of a second, and the collector answers
allocation counts: hundreds of collections of the young generations and a full collection of
every object in the process, the trainer's and torch's included, a large share of the set-up's
time (docs/design.md, "A manifest of many shards"). They find nothing: what is built is tuples
and lists of numbers, which hold no cycles. Paused (``paused``: reading the manifests, building
the plan and, in a loader without worker processes, its first batch), the collector resumes as
it was once the set-up is done: one young-generation collection then finds the tuples of
numbers and stops tracking them, so no full collection is owed for them later in the pass.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block, and back on after it (if it was on): nested blocks,
    and a trainer that turned it off itself, are left as they are."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
