"""The save/restore contract every stage keeps, checked at every position of its output.

Modelled on torchdata's ``run_test_save_load_state`` (``test/nodes/utils.py``): pull the whole
output of a fresh stage once; then for every k, pull k items from another fresh stage, save
its state (through JSON, as a checkpoint would), restore it into a fresh stage, and check that
the rest of the output is the reference's tail. The stage that saved must go on unchanged
too: ``state_dict()`` only reads.
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

S = TypeVar("S")


def drain(stage: S, pull: Callable[[S], Any], limit: int) -> list:
    """Up to ``limit`` items of ``pull(stage)``, until it raises ``StopIteration``."""
    out = []
    for _ in range(limit):
        try:
            out.append(pull(stage))
        except StopIteration:
            break
    return out


def run_test_save_load_state(make: Callable[[], S], pull: Callable[[S], Any] = next, *,
                             limit: int = 10_000, every: int = 1) -> list:
    """Check the save/restore contract of the stages ``make()`` builds; return the reference.

    Args:
        make: a fresh stage, the same every call (its source included).
        pull: the next item of a stage as a comparable value (``==``); raises
            ``StopIteration`` at the end. ``next`` by default.
        limit: the most items pulled from one stage (an infinite stage never ends).
        every: save at every ``every``-th position only (1: at each).
    """
    reference = drain(make(), pull, limit)
    assert reference, "the stage handed out nothing"
    for k in range(0, len(reference) + 1, every):
        saver = make()
        assert drain(saver, pull, k) == reference[:k]
        state = json.loads(json.dumps(saver.state_dict()))
        assert drain(saver, pull, limit - k) == reference[k:], f"saving at {k} changed the stage"
        saver.close()
        restored = make()
        restored.load_state_dict(state)
        tail = drain(restored, pull, limit - k)
        restored.close()
        assert len(tail) == len(reference) - k, f"restored at {k}: {len(tail)} items, expected {len(reference) - k}"
        for i, (got, want) in enumerate(zip(tail, reference[k:])):
            assert got == want, f"restored at {k}: item {k + i} differs"
    return reference
