"""BlockIterator: one worker's blocks from ``PackedTokenDataset``, with a resumable cursor.

``iter(dataset)`` returns a ``BlockIterator`` for the calling DataLoader worker (worker 0 of
1 outside a worker process). It yields the blocks of that worker's pipeline one at a time and
takes the pipeline state after each block it hands out, so ``state_dict()`` is always the
cursor just past the last block the caller received.

That is the protocol torchdata's ``StatefulDataLoader`` looks for on an ``IterableDataset``'s
iterator: it calls ``state_dict()`` in each worker (or in the main process with
``num_workers=0``) and, on resume, ``load_state_dict(state)`` on a fresh iterator of the same
worker before asking it for anything. A resume re-reads what the cursor points at (the
shuffle window it is in), never the blocks before it.

The state is plain data (JSON-serializable)::

    {"version": 1, "fingerprint": "...", "config": {...dataset.describe()...},
     "rank": r, "worker": w, "num_workers": W, "done": false,
     "pipeline": WorkerPipeline state after the last block handed out, or None}

``config`` is there so a mismatch can be named, not just detected; ``fingerprint`` is its
digest (``state.fingerprint``).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Iterator

import torch
from torch.utils.data import get_worker_info

from .batch import expand
from ..errors import ResumeMismatchError
from ..resume.state import config_differences, config_fingerprint, content_digest, fingerprint

BLOCK_STATE_VERSION = 2  # 2: with a digest of the rest; 1 (without) is still read, its values checked
BLOCK_STATE_KEYS = ("version", "fingerprint", "config", "rank", "worker", "num_workers", "done", "pipeline")
_WHAT = "PackedTokenDataset iterator state"


def worker_topology() -> tuple[int, int]:
    """(worker id, number of workers) of the calling DataLoader worker; (0, 1) outside one."""
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class BlockIterator(Iterator[dict[str, torch.Tensor]]):
    """The blocks of DataLoader worker ``worker`` of ``num_workers`` (default: the calling
    worker), one dict of tensors at a time; one finite pass, or endless with ``infinite=True``.

    Nothing is read until the first block is asked for; ``load_state_dict`` is to be called
    before that (loading later discards the blocks in flight and continues from the state).
    """

    def __init__(self, dataset: Any, worker: int | None = None, num_workers: int | None = None) -> None:
        if worker is None or num_workers is None:
            worker, num_workers = worker_topology()
        self.dataset = dataset
        self.worker = int(worker)
        self.num_workers = int(num_workers)
        # through JSON, so a state that went through JSON compares equal to a fresh one
        self.config = json.loads(json.dumps(dataset.describe()))
        self.fingerprint = fingerprint(self.config)
        self.pipeline = None
        self._pipeline_state: dict[str, Any] | None = None  # after the last block handed out
        self._done = False

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> BlockIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._done:
            raise StopIteration
        if self.pipeline is None:
            self.pipeline = self._build(self._pipeline_state)
        try:
            rows = self.pipeline.next_batch(1)
        except BaseException:
            # like a generator that raised: nothing more comes out of this iterator; the
            # state stays that of the last block handed out, so a new one can resume there
            self._done = True
            self.close()
            raise
        if rows is None:
            self._done = True
            self.close()
            raise StopIteration
        cfg = self.dataset.config
        block = expand(rows, boundary=cfg.boundary, provenance=cfg.provenance)
        self._pipeline_state = self.pipeline.state_dict()
        return {k: v[0] for k, v in block.items()}

    def _build(self, state: dict[str, Any] | None):
        """This worker's pipeline, at the start of the pass or restored from ``state``."""
        pipeline = self.dataset.make_pipeline(self.worker, self.num_workers)
        if state is not None:
            try:
                pipeline.load_state_dict(copy.deepcopy(state))
            except BaseException:
                pipeline.close()
                raise
        return pipeline

    def close(self) -> None:
        """Close the pipeline's sources (prefetch threads, open files); idempotent."""
        pipeline, self.pipeline = self.pipeline, None
        if pipeline is not None:
            pipeline.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The cursor just past the last block handed out (plain data, a fresh copy), with a
        digest of the rest: a state changed after it was written is refused."""
        state = {
            "version": BLOCK_STATE_VERSION,
            "fingerprint": self.fingerprint,
            "config": copy.deepcopy(self.config),
            "rank": self.dataset.rank,
            "worker": self.worker,
            "num_workers": self.num_workers,
            "done": self._done,
            "pipeline": copy.deepcopy(self._pipeline_state),
        }
        state["digest"] = content_digest(state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from ``state_dict`` of the same worker of the same job).

        Raises ``ResumeMismatchError`` before anything is read for the blocks when the
        state is of another version, dataset configuration, rank, worker or number of
        workers (naming each field with the saved and the current value), or when its
        cursors point outside this worker's data (naming the stage and the value)."""
        self.check_state(state)
        self.close()
        self._pipeline_state = copy.deepcopy(state["pipeline"])
        self._done = bool(state["done"])

    def check_state(self, state: Any) -> None:
        """Raise ``ResumeMismatchError`` unless ``state`` can resume this iterator exactly
        (reads record indexes for the cursor checks, never tokens)."""
        if not isinstance(state, dict):
            raise ResumeMismatchError(f"{_WHAT} must be a dict, got {type(state).__name__}")
        version = state.get("version")
        if version not in (1, BLOCK_STATE_VERSION) or isinstance(version, bool):
            raise ResumeMismatchError(f"{_WHAT}: version {version!r}, this streamforge reads {BLOCK_STATE_VERSION}")
        digested = "digest" in state  # version 2 states always carry one, version 1 states never
        if digested != (version == BLOCK_STATE_VERSION) or (
                digested and state["digest"] != content_digest({k: v for k, v in state.items() if k != "digest"})):
            raise ResumeMismatchError(f"{_WHAT}: its digest does not match its content: the state was changed "
                                      "after state_dict() wrote it (edited, truncated or corrupted)")
        missing = [k for k in BLOCK_STATE_KEYS if k not in state]
        if missing:
            raise ResumeMismatchError(f"{_WHAT} lacks {missing}")
        if not isinstance(state["done"], bool) or not (state["pipeline"] is None or isinstance(state["pipeline"], dict)):
            raise ResumeMismatchError(f"{_WHAT}: done must be true or false and pipeline a mapping or null")
        differences = self.differences(state)
        if differences:
            raise ResumeMismatchError(
                f"{_WHAT} does not belong to this iterator (worker {self.worker} of {self.num_workers}, "
                f"rank {self.dataset.rank}): " + "; ".join(differences)
            )
        if state["pipeline"] is not None:
            probe = self.dataset.make_pipeline(self.worker, self.num_workers)
            try:
                probe.check_state(state["pipeline"])
            finally:
                probe.close()

    def differences(self, state: dict[str, Any]) -> list[str]:
        """Why ``state`` is not this iterator's, one ``field: saved a, now b`` line each."""
        out = config_differences(state["config"], self.config) if isinstance(state["config"], dict) else [
            f"config: saved {state['config']!r}, now a dict"
        ]
        if not out and config_fingerprint(state["config"]) != self.fingerprint:
            out.append(f"fingerprint: saved {state['fingerprint']!r}, now {self.fingerprint!r}")
        for key, now in (("rank", self.dataset.rank), ("num_workers", self.num_workers), ("worker", self.worker)):
            if state[key] != now:
                out.append(f"{key}: saved {state[key]!r}, now {now!r}")
        return out
