"""StreamingLoader: batches from worker pipelines, with resumable state.

Each of the W logical workers of a rank runs one ``WorkerPipeline`` and builds whole batches
(``RowBatch``, ~2 bytes per token) that cross the process boundary in one buffer; this
process expands them into the batch contract, pins them and moves them to the device.

Order and state. Batches are taken from the logical workers round-robin; a worker whose
pass is over answers with an end marker instead of stopping, so torch's round-robin never
reshuffles. The loader keeps, per logical worker, the pipeline state sent along with the
last batch *handed to the caller* (batches still prefetched in workers do not count), and
which worker is next. On resume, DataLoader worker ``k`` plays logical worker
``(k + next_worker) % W`` so the first batch comes from the right one.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .batch import RowBatch, expand
from .dataset import PackedTokenDataset
from .errors import ConfigError, ResumeMismatchError
from .resume import statistical_worker_states
from .state import STATE_VERSION, ResumeReport, config_differences, fingerprint

_STATE_KEYS = ("version", "fingerprint", "config", "epoch", "batches", "next_worker", "workers", "exhausted")


def _identity(item):
    return item


class _WorkerBatches(IterableDataset):
    """What runs inside each DataLoader worker process."""

    def __init__(self, dataset, num_logical, epoch, states, exhausted, rotation, batch_size):
        self.dataset = dataset
        self.num_logical = num_logical
        self.epoch = epoch
        self.states = states
        self.exhausted = exhausted
        self.rotation = rotation
        self.batch_size = batch_size

    def __iter__(self):
        info = get_worker_info()
        logical = (info.id + self.rotation) % self.num_logical
        if not self.exhausted[logical]:
            pipeline = self.dataset.make_pipeline(logical, self.num_logical, first_pass=self.epoch)
            if self.states[logical] is not None:
                pipeline.load_state_dict(self.states[logical])
            try:
                while True:
                    rows = pipeline.next_batch(self.batch_size)
                    if rows is None:
                        break
                    yield ("batch", logical, rows, pipeline.state_dict(), pipeline.stats(), pipeline.skipped())
            finally:
                pipeline.close()
        while True:  # keep torch's round-robin fixed: answer, never stop
            yield ("end", logical, None, None, None, None)


class StreamingLoader:
    """Iterable of batches (dicts of tensors) with exact ``state_dict``/``load_state_dict``."""

    def __init__(
        self,
        dataset: PackedTokenDataset,
        *,
        batch_size: int,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool | None = None,
        device: torch.device | str | None = None,
        multiprocessing_context: str | None = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.num_logical = max(self.num_workers, 1)
        self.prefetch_factor = prefetch_factor
        self.multiprocessing_context = multiprocessing_context
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.pin_memory = (self.device.type == "cuda") if pin_memory is None else bool(pin_memory)
        self.resume_report: ResumeReport | None = None
        self._config = {**dataset.describe(), "batch_size": self.batch_size, "workers_per_rank": self.num_logical}
        self._fingerprint = fingerprint(self._config)
        self._live = None  # the in-process pipeline while one is iterating
        self._stats: dict[int, dict] = {}
        self._skipped: dict[int, list] = {}
        self._start_epoch(0)

    # -- state -----------------------------------------------------------------------------
    def _start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._batches = 0
        self._next_worker = 0
        self._worker_states: list[dict | None] = [None] * self.num_logical
        self._exhausted = [False] * self.num_logical

    def state_dict(self) -> dict[str, Any]:
        """The state after the last batch handed out (JSON-serializable)."""
        return copy.deepcopy({
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint,
            "config": self._config,
            "epoch": self._epoch,
            "batches": self._batches,
            "next_worker": self._next_worker,
            "workers": self._worker_states,
            "exhausted": self._exhausted,
            "skipped": self.skipped(),
        })

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: exactly when the configuration matches, else statistically
        (``resume_report`` says which, and what was approximated)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ResumeMismatchError(f"loader state version {got!r}, this streamforge reads {STATE_VERSION}")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ResumeMismatchError(f"loader state lacks {missing}")
        state = copy.deepcopy(state)
        skipped = state.get("skipped", [])
        if state["fingerprint"] == self._fingerprint and state["config"] == self._config:
            self._epoch = int(state["epoch"])
            self._batches = int(state["batches"])
            self._next_worker = int(state["next_worker"])
            self._worker_states = state["workers"]
            self._exhausted = [bool(x) for x in state["exhausted"]]
            self.resume_report = ResumeReport(
                "exact",
                f"epoch {self._epoch}, after batch {self._batches}: every stage restored from its "
                "cursor; the next batches are those of the uninterrupted run",
                skipped=skipped,
            )
            return
        differences = config_differences(state["config"], self._config)
        if not differences:
            differences = [f"fingerprint {state['fingerprint']} != {self._fingerprint}"]
        states, approximations = statistical_worker_states(self.dataset, state, self.num_logical)
        self._start_epoch(int(state["epoch"]))
        self._worker_states = states
        self.resume_report = ResumeReport(
            "statistical",
            "the configuration changed, so the saved cursors cannot be replayed exactly; "
            "continuing from the same position in each stream's pass with the same mixture",
            differences=differences,
            approximations=approximations,
            skipped=skipped,
        )

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters summed over this rank's workers (as of the last batch handed out)."""
        self._collect_live_stats()
        total: dict[str, Any] = {"batches": self._batches, "epoch": self._epoch}
        for worker_stats in self._stats.values():
            _accumulate(total, worker_stats)
        _ratios(total)
        return total

    def skipped(self) -> list[dict[str, Any]]:
        self._collect_live_stats()
        return [item for items in self._skipped.values() for item in items]

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if all(self._exhausted):
            self._start_epoch(self._epoch + 1)
        items = self._in_process() if self.num_workers == 0 else self._from_workers()
        for logical, rows, state, stats, skipped in items:
            batch = self._finish(rows)
            self._worker_states[logical] = state
            if stats is not None:  # workers send their counters with every batch
                self._stats[logical] = stats
                self._skipped[logical] = skipped
            self._next_worker = (logical + 1) % self.num_logical
            self._batches += 1
            yield batch
        self._start_epoch(self._epoch + 1)

    def _in_process(self):
        """Batches built in this process. Counters are read from the live pipeline when asked
        for (``_collect_live_stats``); the state is taken after every batch (under a
        microsecond), so a failure inside a batch never leaks into it."""
        if self._exhausted[0]:
            return
        pipeline = self.dataset.make_pipeline(0, 1, first_pass=self._epoch)
        if self._worker_states[0] is not None:
            pipeline.load_state_dict(self._worker_states[0])
        self._live = pipeline
        try:
            while True:
                rows = pipeline.next_batch(self.batch_size)
                if rows is None:
                    self._exhausted[0] = True
                    return
                yield 0, rows, pipeline.state_dict(), None, None
        finally:
            self._collect_live_stats()
            self._live = None
            pipeline.close()

    def _collect_live_stats(self) -> None:
        pipeline = self._live
        if pipeline is not None:
            self._stats[0] = pipeline.stats()
            self._skipped[0] = pipeline.skipped()

    def _from_workers(self):
        source = _WorkerBatches(
            self.dataset, self.num_logical, self._epoch, self._worker_states, self._exhausted,
            self._next_worker, self.batch_size,
        )
        loader = DataLoader(
            source, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
            prefetch_factor=self.prefetch_factor, multiprocessing_context=self.multiprocessing_context,
        )
        iterator = iter(loader)
        try:
            while not all(self._exhausted):
                kind, logical, rows, state, stats, skipped = next(iterator)
                if kind == "end":
                    self._exhausted[logical] = True
                    self._next_worker = (logical + 1) % self.num_logical
                    continue
                yield logical, rows, state, stats, skipped
        finally:
            iterator._shutdown_workers()
            del iterator

    def _finish(self, rows: RowBatch) -> dict[str, torch.Tensor]:
        cfg = self.dataset.config
        batch = expand(rows, boundary=cfg.boundary, provenance=cfg.provenance)
        if self.pin_memory:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        if self.device.type != "cpu":
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return batch


def _accumulate(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(value, dict):
            _accumulate(total.setdefault(key, {}), value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            total[key] = total.get(key, 0) + value


def _ratios(total: dict[str, Any]) -> None:
    """Ratios do not add up across workers: recompute them from the summed counters."""
    for value in total.values():
        if isinstance(value, dict):
            _ratios(value)
    if "bytes_fetched" in total and "bytes_needed" in total:
        needed = total["bytes_needed"]
        total["read_amplification"] = total["bytes_fetched"] / needed if needed else 0.0
