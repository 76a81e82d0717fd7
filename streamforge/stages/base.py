"""The stage contract, and the strict state check every stage shares.

A worker's pipeline is a chain of stages, each pulling from the one before it, its ``source``:

    ShardSource -> ShardReader -> ShuffleBuffer -> Interleaver -> Packer

(the interleaver pulls from one shuffle buffer per stream, its ``sources``). Every stage is an
iterator with plain-data state (``Stage``). State is a cursor into the data, never a copy of
it: restoring re-reads what the cursor points at. A stage's state nests its source's state
under the key the saved layout has always used (``"reader"``, ``"sources"``, ``"source"``).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Protocol, TypeVar, runtime_checkable

from ..errors import ResumeMismatchError

T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class Stage(Protocol[T_co]):
    """What every stage implements: pull the next item, save and restore a cursor, close.

    Besides this contract a stage has the bulk pulls its consumer uses on the hot path
    (``ShardReader.read``, ``ShuffleBuffer.take_run``, ``Interleaver.take_run``,
    ``Packer.next_rows``); ``__next__`` hands out the same data one item at a time.
    """

    def __iter__(self) -> Iterator[T_co]:
        """The stage itself."""
        ...

    def __next__(self) -> T_co:
        """The next item of the stage's output.

        Raises:
            StopIteration: a finite stage is exhausted (an infinite one never is).
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """The cursor after the last item handed out: JSON-able (ints, strings, lists, dicts),
        nesting the source's state. Reading it changes nothing."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved cursor; call on a fresh stage, before its first pull.

        Args:
            state: what ``state_dict()`` returned, possibly after a JSON round trip.

        Raises:
            ResumeMismatchError: ``state`` lacks a key or points outside this stage's data.
        """
        ...

    def close(self) -> None:
        """Let go of what the stage holds (its window, its source's threads and handles)."""
        ...


def check_state(state: Any, keys: Iterable[str], stage: str) -> None:
    """Raise ``ResumeMismatchError`` naming the stage and the missing keys.

    Args:
        state: a saved state, expected to be a dict.
        keys: the keys it must have.
        stage: the stage's name, for the message.
    """
    if not isinstance(state, dict):
        raise ResumeMismatchError(f"{stage}: state must be a dict, got {type(state).__name__}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ResumeMismatchError(f"{stage}: state lacks {missing} (has {sorted(state)})")
