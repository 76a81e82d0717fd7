"""What every stage shares: plain-data state, loaded strictly.

A stage is an object with ``state_dict()`` (JSON-serializable: ints, strings, lists, dicts)
and ``load_state_dict(state)``, called on a fresh stage before it produces anything. State
is a cursor into the data, never a copy of it: restoring re-reads what the cursor points at.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..errors import ResumeMismatchError


def check_state(state: Any, keys: Iterable[str], stage: str) -> None:
    """Raise ``ResumeMismatchError`` naming the stage and the missing keys."""
    if not isinstance(state, dict):
        raise ResumeMismatchError(f"{stage}: state must be a dict, got {type(state).__name__}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ResumeMismatchError(f"{stage}: state lacks {missing} (has {sorted(state)})")
