"""StreamingLoader: a rank's batches on the job clock, with resumable state.

Each of the W logical workers of a rank runs one ``WorkerPipeline`` and builds whole batches
(``RowBatch``, ~2 bytes per token), in a DataLoader process (``workers.py``); this process
expands them into the batch contract, pins them and moves them to the device.

The clock. The rank's local batch ``i`` of a pass comes from logical worker ``i % W`` and has
global step ``pass_first_step + i`` (``plan.PassPlan``): the same number on every rank. A
finite pass has ``steps_per_pass`` steps on every rank, computed from the corpus metadata
before the first batch; each worker builds exactly its share of them, all full. Steps in
``skip_steps`` are built (their data consumed) and dropped here.

Order and state. The loader keeps, per logical worker, the pipeline state sent along with
the last batch *handed to the caller* (batches still prefetched in workers do not count). On
resume, DataLoader worker ``k`` plays logical worker ``(k + i) % W`` so the first batch comes
from the right one. The state itself, and the exact, elastic and statistical ways of resuming
from it, are in ``checkpoint.py``.

Head start. With worker processes, the first batch of an iteration is built in this process
(``_head_start``: the logical worker's pipeline from its state, without read-ahead threads,
closed before any fork; a restored window fetches its first batch's frames on threads joined
before the read returns, ``ShardSource.fetch_now``), and the worker processes start from the
state after it: the trainer's first step does not wait for processes to start, build their
pipelines and fill their first windows, and the workers start while that step runs. With 2
workers on the 50M-token corpus of ``tools/bench_peers.py`` (one process, 10 starts each):
a first batch 0.037-0.054 -> 0.003-0.005 s, a resume halfway through a window 0.047-0.063 ->
0.013-0.027 s; a whole pass's tokens/s unchanged (``tools/bench_against.py``, 0.994x).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch

from . import collector
from ..ledger import store as ledger
from ..pipeline.batch import RowBatch, check_fields, expand
from ..resume.checkpoint import Checkpointing
from .counters import Counters
from ..pipeline.dataset import PackedTokenDataset, whole
from .device import DeviceFeed, check_depth, default_device
from ..errors import ConfigError
from ..planning.plan import PassPlan
from ..planning.schedule import SkipRanges
from ..resume.state import ResumeReport, fingerprint
from .workers import _Job, per_message, process_batches


class StreamingLoader(Checkpointing):
    """Iterable of batches (dicts of tensors) on the job clock, with exact
    ``state_dict``/``load_state_dict``.

    ``device`` (default: the rank's CUDA device, else the CPU) is where batches arrive;
    ``device_prefetch`` batches (default 2 on CUDA, 0 elsewhere) are expanded, pinned and
    copied ahead on a background thread (``device.DeviceFeed``).

    ``skip_steps=[(start, end), ...]`` drops the batches of those global steps (end
    exclusive), e.g. to jump over a loss spike; it can be given when resuming.

    ``fields`` (default: all five of the batch contract, docs/batch.md) names the tensors a
    batch holds; the others are not computed. It changes nothing but what is handed out: the
    data order, the state and the job clock are the same with any fields.

    ``ledger_dir`` (a local path or any fsspec URL; ``ledger_options``: its storage options)
    keeps a data-order ledger: the document pieces of every step, written in chunks and
    always before ``state_dict()`` returns (``streamforge ledger check|diff|show``,
    docs/ledger.md).
    """

    def __init__(
        self,
        dataset: PackedTokenDataset,
        *,
        batch_size: int,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool | None = None,
        device: torch.device | str | None = None,
        device_prefetch: int | None = None,
        multiprocessing_context: str | None = None,
        skip_steps: Any = None,
        ledger_dir: str | None = None,
        ledger_options: dict[str, Any] | None = None,
        fields: Sequence[str] | None = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = whole("batch_size", batch_size, 1)
        self.num_workers = whole("num_workers", num_workers, 0)
        self.num_logical = max(self.num_workers, 1)
        self.prefetch_factor = whole("prefetch_factor", prefetch_factor, 1)
        self.multiprocessing_context = multiprocessing_context
        self.device = default_device() if device is None else torch.device(device)
        self.device_prefetch = check_depth(device_prefetch, self.device)  # batches in flight (device.py)
        self.pin_memory = (self.device.type == "cuda") if pin_memory is None else bool(pin_memory)
        self.fields = check_fields(fields)
        self.skip_steps = SkipRanges(skip_steps)
        if dataset.evaluation and self.skip_steps:
            raise ConfigError("skip_steps does not apply to an evaluation loader: its pass holds every held-out token")
        self.resume_report: ResumeReport | None = None
        self._config = {**dataset.describe(), "batch_size": self.batch_size, "workers_per_rank": self.num_logical}
        self._fingerprint = fingerprint(self._config)
        self._live = None  # the in-process pipeline while one is iterating
        self._stats: dict[int, dict] = {}
        self._skipped: dict[int, list] = {}
        self._head: tuple = ()  # (stats, skipped) of the iteration's head start (_head_start)
        self._counters = Counters(dataset.stream_names, dataset.schedule)
        self._plan: PassPlan | None = None
        # after a resume on another topology: what is left of the pass, {"work": ...} (elastic)
        # or {"fractions": [...]} (statistical); None for a whole pass
        self._remaining: dict[str, Any] | None = None
        self._start_pass(0, 0)
        self._ledger = None if ledger_dir is None else ledger.for_loader(self, ledger_dir, ledger_options)

    @property
    def infinite(self) -> bool:
        return self.dataset.config.infinite

    @property
    def evaluation(self) -> bool:
        return self.dataset.evaluation

    # -- the clock -------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The global step of the next batch (the same on every rank)."""
        return self._first_step + self._batch

    @property
    def steps_per_pass(self) -> int:
        """Steps (batches per rank) in the current pass: known before its first batch. With
        ``infinite=True`` the streams' passes run on their own; this is the steps one pass
        of every stream gives."""
        return self.plan().steps

    def plan(self) -> PassPlan:
        """The plan of the current pass (after a statistical resume: of what is left of it)."""
        if self._plan is None or self._plan.pass_idx != self._pass:
            with collector.paused():  # record ranges: a few objects per shard
                self._plan = self.dataset.pass_plan(
                    self._pass, workers_per_rank=self.num_logical, batch_size=self.batch_size,
                    first_step=self._first_step if not self.infinite else 0,
                )
        return self._plan

    def _start_pass(self, pass_idx: int, first_step: int) -> None:
        self._pass = pass_idx
        self._first_step = first_step
        self._batch = 0
        self._pass_tokens = 0
        self._worker_states: list[dict | None] = [None] * self.num_logical
        self._remaining = None
        self._plan = None

    def _next_pass(self) -> tuple[int, int, int]:
        """``(pass, first step, tokens dropped)`` once this pass ends: the next pass and its
        first step, and this rank's tokens of this pass that no full step holds."""
        plan = self.plan()
        dropped = max(0, plan.rank_tokens(self.dataset.rank) - self._pass_tokens)
        return self._pass + 1, self._first_step + plan.steps, dropped

    def _end_pass(self) -> None:
        pass_idx, first_step, dropped = self._next_pass()
        self._counters.dropped_tokens += dropped
        self._start_pass(pass_idx, first_step)

    def _pass_over(self) -> bool:
        """All of the pass's steps were handed out (an empty pass is over once iterated)."""
        return not self.infinite and 0 < self._batch and self._batch >= self.plan().steps

    def _warn_empty_pass(self) -> None:
        cfg, plan = self.dataset.config, self.plan()
        warnings.warn(
            f"streamforge: pass {self._pass} has 0 steps, so this iteration yields no batch: rank "
            f"{self.dataset.rank}'s share of the pass, {plan.rank_tokens(self.dataset.rank):,} tokens over "
            f"{self.num_logical} worker(s), cannot fill one full batch of {self.batch_size} row(s) x seq_len "
            f"{cfg.seq_len} on every worker of the {self.dataset.world_size} rank(s); use a smaller batch_size "
            "or seq_len, fewer ranks or workers, or infinite=True",
            stacklevel=3,
        )

    def _quotas(self) -> list[int]:
        plan = self.plan()
        return [plan.batches_of(w) for w in range(self.num_logical)]

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Plain data: the step and phase, tokens and documents per stream and per phase in
        the batches handed out, skipped and dropped counts, and storage counters (summed
        over this rank's workers, as of the last batch handed out)."""
        self._collect_live_stats()
        out = self._counters.report(self.step)
        out.update({"pass": self._pass, "batch": self._batch, "skip_steps": self.skip_steps.to_list()})
        if not self.infinite:
            out["steps_per_pass"] = self.steps_per_pass
        storage: dict[str, Any] = {}
        for worker_stats in [*self._stats.values(), *self._head[:1]]:
            _accumulate(storage, worker_stats)
        _ratios(storage)
        for name in self.dataset.stream_names:
            out["streams"][name].update(storage.pop(name, {}))
        out.update(storage)
        return out

    def skipped(self) -> list[dict[str, Any]]:
        self._collect_live_stats()
        return [item for items in [*self._skipped.values(), *self._head[1:]] for item in items]

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.evaluation:  # every iteration is the same pass, from the top
            plan = self._plan
            self._start_pass(0, 0)
            self._plan = plan
            self._counters = Counters(self.dataset.stream_names, self.dataset.schedule)
            self._stats.clear()
            self._head = ()
        elif self._pass_over():
            self._end_pass()
        if not self.infinite and not self.evaluation and self._batch == 0 and self.plan().steps == 0:
            self._warn_empty_pass()
        items = self._in_process() if self.num_workers == 0 else self._from_workers()
        skips = self.skip_steps if self.skip_steps else None
        feed = DeviceFeed(self._finish, self.device, self.device_prefetch)
        counters, take = self._counters, feed.open(self._tallied(items))
        try:
            for got in _taken(take, pause=self.num_workers == 0):
                logical, step, rows, state, stats, skipped, tally = got[0]
                if step != self._first_step + self._batch:
                    raise RuntimeError(f"worker {logical} built step {step}, the loader expected {self.step}")
                dropped = skips is not None and step in skips
                if self._ledger is not None:  # a step it holds past the state is voided on resume
                    self._ledger.add(step, self._pass, rows, skipped=dropped)
                # Everything that can take time or fail comes first: an exception raised here (a
                # KeyboardInterrupt inside next(), say) leaves the state at the batches handed out.
                batch = None if dropped else feed.hand_out(got)
                # The commit: the counters' one call (which changes nothing until its last
                # line), then plain stores and the yield, where CPython runs no signal handler.
                if dropped:
                    counters.skip(tally[0])
                else:
                    counters.add(tally, step)
                self._worker_states[logical] = state
                if stats is not None:  # workers send their counters with every message
                    self._stats[logical] = stats
                    self._skipped[logical] = skipped
                self._batch += 1
                self._pass_tokens += tally[0]
                if batch is not None:
                    yield batch
        finally:
            feed.close()
        if not self.infinite and not self.evaluation:
            self._end_pass()
        if self._ledger is not None:
            self._ledger.flush()

    def _tallied(self, items):
        """The raw items with each batch's counts appended; computed where the items are
        produced (the feed's thread when prefetching), so the training thread only adds."""
        tally = self._counters.tally
        try:
            for item in items:
                yield (*item, tally(item[2]))
        finally:
            items.close()

    def _job(self, states, batch: int | None = None, dataset: PackedTokenDataset | None = None):
        """What a worker needs to build its share from ``states``, the next batch being the
        pass's ``batch`` (default: the next one handed out)."""
        plan = None if self.infinite else self.plan()
        cfg = self.dataset.config
        batch = self._batch if batch is None else batch
        return _Job(
            dataset or self.dataset, self.num_logical, self._pass, 0 if plan is None else plan.first_step,
            None if plan is None else self._quotas(), states, batch % self.num_logical, self.batch_size,
            self._work_plan(), per_message(self.batch_size, cfg.seq_len, self.dataset.token_dtype.itemsize),
        )

    def _steps_left(self) -> int | None:
        return None if self.infinite else self.plan().steps - self._batch

    def _in_process(self):
        """Batches built in this process. Counters are read from the live pipeline when asked
        for (``_collect_live_stats``); the state is taken after every batch (under a
        microsecond), so a failure inside a batch never leaks into it."""
        left = self._steps_left()
        if left == 0:
            return
        pipeline = self._job(self._worker_states).pipeline(0)
        try:
            self._live = pipeline
            while left is None or left > 0:
                step = pipeline.step
                rows = pipeline.next_batch(self.batch_size)
                if rows is None:
                    raise RuntimeError(f"the pipeline ended at step {step}, before its share of the pass")
                left = None if left is None else left - 1
                yield 0, step, rows, pipeline.state_dict(), None, None
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
        left = self._steps_left()
        if left == 0:
            return
        # read here, not from the loader as the items are handed out: with a device feed this
        # generator runs ahead of the training thread, which commits each item's state
        states, batch = list(self._worker_states), self._batch
        self._head = ()
        item = self._head_start(states, batch)
        yield item
        states[item[0]] = item[3]
        left = None if left is None else left - 1
        if left == 0:
            return
        job = self._job(states, batch + 1)
        yield from process_batches(job, self.num_workers, left, self.prefetch_factor, self.multiprocessing_context)

    def _head_start(self, states, batch: int) -> tuple:
        """The iteration's first batch, built in this process by its logical worker's pipeline
        (restored from its state) while no worker process runs yet. The pipeline reads without
        read-ahead, so no thread of it is alive when the workers are forked; its storage
        counters are kept apart (``_head``) and added to the workers' in ``stats()``."""
        dataset = self.dataset.with_storage(dataclasses.replace(self.dataset.storage, prefetch_bytes=0))
        logical = batch % self.num_logical
        pipeline = self._job(states, batch, dataset).pipeline(logical)
        try:
            step = pipeline.step
            rows = pipeline.next_batch(self.batch_size)
            if rows is None:
                raise RuntimeError(f"worker {logical} ended before its share of pass {self._pass}")
            self._head = (pipeline.stats(), pipeline.skipped())
            return logical, step, rows, pipeline.state_dict(), None, None
        finally:
            pipeline.close()

    def _finish(self, rows: RowBatch) -> dict[str, torch.Tensor]:
        cfg = self.dataset.config
        batch = expand(rows, boundary=cfg.boundary, provenance=cfg.provenance, fields=self.fields)
        if self.pin_memory:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        if self.device.type != "cpu":
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return batch


def _taken(take: Callable[[], Any], pause: bool) -> Iterator[Any]:
    """What ``take`` returns until None; with ``pause``, the first with the garbage collector
    paused, since it sets the pass up (pipelines, first windows: ``collector``). Only for a
    pipeline in this process: with workers the first take is the head start, and the workers
    are forked right after it, with the collector as it would be without streamforge."""
    if pause:
        with collector.paused():
            got = take()
    else:
        got = take()
    while got is not None:
        yield got
        got = take()


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
