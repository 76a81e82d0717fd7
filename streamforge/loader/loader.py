"""StreamingLoader: a rank's batches on the job clock, with resumable state.

Each of the W logical workers of a rank runs one ``WorkerPipeline`` and builds whole batches
(``RowBatch``, ~2 bytes per token), in a DataLoader process (``workers.py``); this process
expands them into the batch contract, pins them and moves them to the device.

The clock. The rank's local batch ``i`` of a pass comes from logical worker ``i % W`` and has
global step ``pass_first_step + i`` (``plan.PassPlan``): the same number on every rank. A
finite pass has ``steps_per_pass`` steps on every rank, computed from the corpus metadata
before the first batch; each worker builds exactly its share of them, all full. Steps in
``skip_steps`` are built (their data consumed) and dropped here.

Order and state. The loader's ``Clock`` (``clock.py``) keeps, per logical worker, the
pipeline state sent along with the last batch *handed to the caller* (batches still
prefetched in workers do not count). On resume, DataLoader worker ``k`` plays logical worker
``(k + i) % W`` so the first batch comes from the right one. Saving that state and the exact,
elastic and statistical ways of resuming from it belong to the loader's ``Checkpointer``
(``resume/checkpoint.py``); live participants that come and go, to ``membership.py``.

Head start. With worker processes, the first batch of an iteration is built in this process
(``_head_start``: the logical worker's pipeline from its state, without read-ahead threads,
closed before any fork; a restored window fetches its first batch's frames on threads joined
before the read returns, ``ShardSource.fetch_now``), and the worker processes start from the
state after it: the first step does not wait for processes to start, build their pipelines and
fill their first windows, and the workers start while it runs (docs/design.md has the figures).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import torch

from ..errors import ConfigError, PipelineInvariantError
from ..ledger.attach import LedgerConfig, for_loader
from ..pipeline.batch import RowBatch, check_fields, expand
from ..pipeline.dataset import BOUNDARIES, PackedTokenDataset, scheduled, whole
from ..planning.plan import PassPlan
from ..planning.schedule import SkipRanges
from ..planning.steps import batch_schedule
from ..resume.checkpoint import Checkpointer
from ..resume.state import ResumeReport, fingerprint
from . import collector, membership
from .clock import Clock
from .counters import Counters
from .device import DeviceFeed, check_depth, default_device, taken
from .passes import start_pass, warn_before_pass
from .stats import loader_stats
from .replicas import check_replicas, receive_from_replica_zero, send_to_replicas
from .workers import WorkerBatch, _Job, per_message, process_batches


class StreamingLoader:
    """Iterable of batches (dicts of tensors) on the job clock, with exact
    ``state_dict``/``load_state_dict``.

    Args:
        dataset: the ``PackedTokenDataset`` whose pipelines build the batches.
        batch_size: rows per batch, on every rank: an int, or a schedule ``[(first_step,
            batch_size), ...]`` keyed by global step (a batch-size ramp; docs/schedules.md).
            ``loader.batch_size`` is the value of the next step.
        tokens_per_step: instead of ``batch_size``, each rank's tokens per step: the batch
            size at each step is ``tokens_per_step // seq_len`` (with a seq_len schedule, a
            batch-size schedule that keeps the tokens of a step constant).
        num_workers: DataLoader worker processes (0: the pipeline runs in this process).
        prefetch_factor: messages each worker process may have in flight.
        pin_memory: pin batches before the copy (default: on CUDA).
        device: where batches arrive (default: the rank's CUDA device, else the CPU).
        device_prefetch: batches expanded, pinned and copied ahead on a background thread
            (default 2 on CUDA, 0 elsewhere; ``device.DeviceFeed``).
        multiprocessing_context: the worker processes' start method (default: torch's).
        skip_steps: ``[(start, end), ...]``, global steps whose batches are dropped (end
            exclusive), e.g. to jump over a loss spike; it can be given when resuming.
        ledger: keep a data-order ledger (``LedgerConfig``: where, its storage options, its
            chunk size): the document pieces of every step, written in chunks and always
            before ``state_dict()`` returns (``streamforge ledger check|diff|show``,
            docs/ledger.md). ``ledger_dir=`` and ``ledger_options=`` are the older spelling
            and keep working.
        fields: the tensors a batch holds (default: all five of the batch contract,
            docs/batch.md); the others are not computed.
        boundary: where the document mask cuts a row, ``"document"`` or ``"stream"``
            (default: the dataset's).
        provenance: add ``segments``, each row's document pieces as (stream, shard, record,
            token_start, length), to the batch (default: the dataset's).
        read_once: in a hybrid-parallel job (a dataset on a ``mesh=`` or ``group=``), only
            replica 0 of each data-parallel rank reads and builds the batches, and broadcasts
            them to its replicas (``replicas.py``, docs/parallelism.md); the batches and the
            state are those without it. Every replica must pass the same value.

    ``fields``, ``boundary`` and ``provenance`` are the batch spec: they change how a batch is
    expanded, never the data order, the state or the job clock, so a state resumes exactly
    under any of them.
    """

    def __init__(
        self,
        dataset: PackedTokenDataset,
        *,
        batch_size: Any = None,
        tokens_per_step: int | None = None,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool | None = None,
        device: torch.device | str | None = None,
        device_prefetch: int | None = None,
        multiprocessing_context: str | None = None,
        skip_steps: Any = None,
        ledger: LedgerConfig | None = None,
        ledger_dir: str | None = None,
        ledger_options: dict[str, Any] | None = None,
        fields: Sequence[str] | None = None,
        boundary: str | None = None,
        provenance: bool | None = None,
        read_once: bool = False,
    ) -> None:
        self.dataset = dataset
        self.batch_sizes = batch_schedule(None if batch_size is None else scheduled("batch_size", batch_size),
                                          tokens_per_step, dataset.seq_lens)  # by step (planning/steps.py)
        if dataset.evaluation and self.batch_sizes.constant is None:
            raise ConfigError("an evaluation loader has one batch_size (an int), not a schedule")
        self.num_workers = whole("num_workers", num_workers, 0)
        self.num_logical = max(self.num_workers, 1)
        self.prefetch_factor = whole("prefetch_factor", prefetch_factor, 1)
        self.multiprocessing_context = multiprocessing_context
        self.device = default_device() if device is None else torch.device(device)
        self.device_prefetch = check_depth(device_prefetch, self.device)  # batches in flight (device.py)
        self.pin_memory = (self.device.type == "cuda") if pin_memory is None else bool(pin_memory)
        self.fields = check_fields(fields)
        self.boundary = dataset.config.boundary if boundary is None else boundary
        if self.boundary not in BOUNDARIES:
            raise ConfigError(f"boundary must be one of {BOUNDARIES}, got {self.boundary!r}")
        self.provenance = dataset.config.provenance if provenance is None else bool(provenance)
        self.skip_steps = SkipRanges(skip_steps)
        if dataset.evaluation and self.skip_steps:
            raise ConfigError("skip_steps does not apply to an evaluation loader: its pass holds every held-out token")
        self.resume_report: ResumeReport | None = None
        self.clock = Clock(self.num_logical)
        self.counters = Counters(dataset.stream_names, dataset.schedule)
        self._live = None  # the in-process pipeline while one is iterating
        self._stats: dict[int, dict] = {}  # storage counters, per logical worker
        self._skipped: dict[int, list] = {}  # skipped damaged records, per logical worker
        self._head: WorkerBatch | None = None  # the iteration's head start (_head_start), for its counters
        if ledger is not None and (ledger_dir is not None or ledger_options is not None):
            raise ConfigError("pass the ledger once: ledger=LedgerConfig(...) or ledger_dir=/ledger_options=, not both")
        if ledger is None and ledger_dir is not None:
            ledger = LedgerConfig(ledger_dir, ledger_options)
        self.read_once = bool(read_once)
        self.membership: membership.Membership | None = None  # live participants (set_membership)
        self._ledger_config = ledger
        self._bind()
        self.checkpointer = Checkpointer(self)

    def _bind(self) -> None:
        """What the loader derives from the dataset's topology: ``config`` (everything
        exactness depends on) and its ``fingerprint`` (what a state must match to resume
        exactly), the replicas' agreement, and the ledger writer of this rank."""
        dataset, ledger = self.dataset, self._ledger_config
        dataset.bind_batch(self.batch_sizes)  # upsampled streams' readings (pipeline/repeats.py)
        self.config = {**dataset.describe(), "batch_size": self.batch_sizes.describe(),
                       "workers_per_rank": self.num_logical}
        self.fingerprint = fingerprint(self.config)
        check_replicas(dataset.topology, fingerprint=self.fingerprint, read_once=self.read_once,
                       skip_steps=self.skip_steps.to_list())
        self.ledger = None if ledger is None else for_loader(self, ledger.url, ledger.storage_options,
                                                               ledger.chunk_steps)

    def check_topology(self) -> None:
        """The dataset's topology checked against torch.distributed (``Topology.checked``):
        a dataset built before the process group existed is bound to the group's ranks now,
        before anything was read; a disagreement raises ``ConfigError``. Called when
        iteration starts, at save and resume time, and by ``plan()``."""
        topology = self.dataset.topology
        now = topology.checked()
        if now is topology:
            return
        if self.clock.step or self.clock.batch or self.resume_report is not None or self.clock.plan is not None:
            raise ConfigError(
                f"the topology changed after the loader started: it read as rank {topology.rank} of "
                f"{topology.world_size} ({topology.source}) and torch.distributed now says rank {now.rank} of "
                f"{now.world_size}; initialize the process group before the loader's first batch, plan or state")
        self.dataset.topology = now
        self._bind()

    @property
    def shares_reads(self) -> bool:
        """``read_once`` with replicas to share with: replica 0 reads for them."""
        return self.read_once and self.dataset.topology.replicas > 1

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
        return self.clock.step

    @property
    def batch_size(self) -> int:
        """Rows per batch at the next step, on every rank (``batch_sizes``: by step)."""
        return self.batch_sizes.at(self.clock.step)

    @property
    def seq_len(self) -> int:
        """Tokens per row at the next step (the dataset's ``seq_lens``: by step)."""
        return self.dataset.seq_lens.at(self.clock.step)

    @property
    def lr_scale(self) -> float:
        """The LR factor of the next step's schedule phase: multiply the scheduler's LR by it."""
        return self.dataset.schedule.lr_scale_at(self.clock.step)

    @property
    def steps_per_pass(self) -> int:
        """Steps (batches per rank) in the current pass: known before its first batch. With
        ``infinite=True`` the streams' passes run on their own; this is the steps one pass
        of every stream gives."""
        return self.plan().steps

    def plan(self, share: bool = False) -> PassPlan:
        """The plan of the current pass (after a statistical resume: of what is left of it).
        ``share=True`` (iteration does, as a pass starts): every rank asks at this point, so
        the ranks compute it together, each reading only its own cuts' record indexes."""
        clock = self.clock
        if clock.plan is None or clock.plan.pass_idx != clock.pass_idx:
            self.check_topology()
            with collector.paused():  # record ranges: a few objects per shard
                batch_size = self.batch_sizes if not self.evaluation else self.batch_sizes.constant
                clock.plan = self.dataset.pass_plan(
                    clock.pass_idx, workers_per_rank=self.num_logical, batch_size=batch_size,
                    first_step=clock.first_step if not self.infinite else 0, share=share,
                )
        return clock.plan

    def next_pass(self) -> tuple[int, int, int]:
        """``(pass, first step, tokens dropped)`` once this pass ends: the next pass and its
        first step, and this rank's tokens of this pass that no full step holds."""
        plan, rank = self.plan(), self.dataset.rank  # token cuts: what no worker was given counts on rank 0
        dropped = max(0, plan.rank_tokens(rank) - self.clock.pass_tokens) + plan.rank_unassigned(rank)
        return self.clock.pass_idx + 1, self.clock.first_step + plan.steps, dropped

    def _end_pass(self) -> None:
        pass_idx, first_step, dropped = self.next_pass()
        self.counters.add_dropped(dropped)
        self.clock.start(pass_idx, first_step)

    def pass_over(self) -> bool:
        """All of the pass's steps were handed out (an empty pass is over once iterated)."""
        return not self.infinite and 0 < self.clock.batch and self.clock.batch >= self.plan().steps

    def quotas(self) -> list[int]:
        """The batches each logical worker builds in this pass."""
        plan = self.plan()
        return [plan.batches_of(w) for w in range(self.num_logical)]

    def work_plan(self) -> PassPlan | None:
        """The plan workers must follow to read their ranges: an evaluation pass's, or the
        rest of a pass after an elastic resume; None when the planner's own ranges apply."""
        if self.evaluation:
            return self.plan()
        rest = self.clock.rest
        if rest is not None and rest.elastic and not self.infinite:
            return self.plan()
        return None

    def _steps_left(self) -> int | None:
        return None if self.infinite else self.plan().steps - self.clock.batch

    # -- state (resume/checkpoint.py) ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The job's state after the last batch handed out (``resume/state.py``): the same dict
        on every rank under torch.distributed (the ranks' cursors are all-gathered here, at
        checkpoint time only, so every rank must call it); without a process group, it holds
        this rank's part only (``merge_states`` joins the ranks'). Calling it changes nothing."""
        return self.checkpointer.save()

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = False, mode: str | None = None) -> None:
        """Continue from ``state`` (``resume_report`` says how and why):

        * ``exact`` when the job matches: the next batches are the uninterrupted run's;
        * ``elastic`` when only the world size, workers per rank or batch size changed: the
          rest of the pass is re-planned over this topology, every token not yet delivered
          exactly once (``resume/elastic.py``);
        * ``statistical`` otherwise (or with ``mode="statistical"``): each stream continues
          at the same fraction of its pass, with bounds on what may repeat or be skipped.

        ``strict=True`` raises ``ResumeMismatchError`` unless the resume is exact. A state
        that is refused leaves the loader as it was."""
        self.check_topology()
        self.checkpointer.load(state, strict=strict, mode=mode)

    def resume_from_counters(self, tokens_seen: Any, *, step: int | None = None) -> None:
        """Continue a job whose only record is the tokens it saw per stream (e.g. from its
        logs): each stream starts that far into its passes, statistically, the counters carry
        those totals, and the windows are reshuffled. ``step`` defaults to the tokens seen over
        the tokens one step delivers. Streams left out count as unseen."""
        self.check_topology()
        self.checkpointer.resume_from_counters(tokens_seen, step=step)

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Plain data: the step and phase, tokens and documents per stream and per phase in
        the batches handed out, skipped and dropped counts, and storage counters (summed
        over this rank's workers, as of the last batch handed out)."""
        return loader_stats(self)

    def skipped(self) -> list[dict[str, Any]]:
        """The damaged records skipped so far (``on_error="skip"``), as of the last batch handed out."""
        self._collect_live_stats()
        head = [self._head.skipped] if self._head is not None else []
        return [item for items in [*self._skipped.values(), *head] for item in items]

    # -- iteration -------------------------------------------------------------------------
    def __len__(self) -> int:
        """Steps in the current pass (``steps_per_pass``), for a finite loader: what a
        framework's loop reads to know a pass's end without fetching ahead (Lightning
        prefetches a batch from a loader without a length). An infinite loader has none
        (``TypeError``)."""
        if self.infinite:
            raise TypeError("an infinite StreamingLoader has no length (steps_per_pass gives one pass's steps)")
        return self.steps_per_pass

    def __bool__(self) -> bool:  # a loader is a loader, whatever its length (or lack of one)
        return True

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return membership.Membership.of(self).iterate(self)  # plain, until set_membership

    def set_membership(self, step: int, participants: Any, rank: int | None = None, cursors=None) -> None:
        """From global ``step`` on, ``participants`` (their number, or them) are live: re-plans the pass there."""
        membership.Membership.of(self).set(step, participants, rank, cursors)

    def _iterate(self) -> Iterator[dict[str, torch.Tensor]]:
        self.check_topology()
        clock = self.clock
        if self.evaluation:  # every iteration is the same pass, from the top
            plan = clock.plan
            clock.start(0, 0)
            clock.plan = plan
            self.counters = Counters(self.dataset.stream_names, self.dataset.schedule)
            self._stats.clear()
            self._head = None
        elif self.pass_over():
            self._end_pass()
        start_pass(self)  # the plan, the first batch's first reads beside it; a pass with no step warns
        warn_before_pass(self)
        topology = self.dataset.topology
        if self.shares_reads and topology.replica > 0:
            items = receive_from_replica_zero(topology, self._steps_left(), self._received)
        else:
            items = self._in_process() if self.num_workers == 0 else self._from_workers()
            if self.shares_reads:
                items = send_to_replicas(items, topology, self._skipped_after)
        skips = self.skip_steps if self.skip_steps else None
        feed = DeviceFeed(self._finish, self.device, 0 if self.shares_reads else self.device_prefetch)
        counters, take = self.counters, feed.open(self._tallied(items))
        try:
            for got in taken(take, pause=self.num_workers == 0):
                item = got.item
                if item.step != clock.step:
                    raise PipelineInvariantError(f"worker {item.logical} built step {item.step}, the loader expected {self.step}")
                dropped = skips is not None and item.step in skips
                if self.ledger is not None:  # a step it holds past the state is voided on resume
                    self.ledger.add(item.step, clock.pass_idx, item.rows, skipped=dropped)
                # Everything that can take time or fail comes first: an exception raised here (a
                # KeyboardInterrupt inside next(), say) leaves the state at the batches handed out.
                batch = None if dropped else feed.hand_out(got)
                totals = counters.after_skip(item.tally) if dropped else counters.after(item.tally, item.step)
                # The commit: plain stores and the yield, where CPython runs no signal handler.
                counters.totals, counters.last = totals, item.tally
                clock.worker_states[item.logical] = item.state
                if item.stats is not None:  # workers send their counters with every message
                    self._stats[item.logical] = item.stats
                    self._skipped[item.logical] = item.skipped
                clock.batch += 1
                clock.pass_tokens += item.tally.num_tokens
                if batch is not None:
                    yield batch
        finally:
            feed.close()
        if not self.infinite and not self.evaluation:
            self._end_pass()
        if self.ledger is not None:
            self.ledger.flush()

    def _tallied(self, items: Iterator[WorkerBatch]) -> Iterator[WorkerBatch]:
        """The worker batches with each one's counts set; computed where the items are
        produced (the feed's thread when prefetching), so the training thread only adds."""
        tally = self.counters.tally
        try:
            for item in items:
                item.tally = tally(item.rows)
                yield item
        finally:
            items.close()

    def job(self, states: list[dict | None], batch: int | None = None,
            dataset: PackedTokenDataset | None = None) -> _Job:
        """What a worker needs to build its share from ``states``, the next batch being the
        pass's ``batch`` (default: the next one handed out)."""
        plan = None if self.infinite else self.plan()
        cfg = self.dataset.config
        batch = self.clock.batch if batch is None else batch
        return _Job(
            dataset=dataset or self.dataset, num_logical=self.num_logical, pass_idx=self.clock.pass_idx,
            first_step=0 if plan is None else plan.first_step, quotas=None if plan is None else self.quotas(),
            states=states, rotation=batch % self.num_logical, batch_sizes=self.batch_sizes, plan=self.work_plan(),
            per_message=per_message(self.batch_sizes.largest, cfg.seq_len, self.dataset.token_dtype.itemsize),
        )

    def _in_process(self) -> Iterator[WorkerBatch]:
        """Batches built in this process. Counters are read from the live pipeline when asked
        for (``_collect_live_stats``); the state is taken after every batch (under a
        microsecond), so a failure inside a batch never leaks into it."""
        left = self._steps_left()
        if left == 0:
            return
        pipeline = self.job(self.clock.worker_states).pipeline(0)
        try:
            self._live = pipeline
            while left is None or left > 0:
                step = pipeline.step
                rows = pipeline.next_batch(self.batch_sizes.at(step))
                if rows is None:
                    raise PipelineInvariantError(f"the pipeline ended at step {step}, before its share of the pass")
                left = None if left is None else left - 1
                yield WorkerBatch(0, step, rows, pipeline.state_dict())
        finally:
            self._collect_live_stats()
            self._live = None
            pipeline.close()

    def _skipped_after(self, item: WorkerBatch) -> list:
        """What ``skipped()`` will say once ``item`` is handed out (read_once sends it along)."""
        parts = dict(self._skipped)
        if item.stats is not None:
            parts[item.logical] = item.skipped
        elif self._live is not None:
            parts[0] = self._live.skipped()
        head = [self._head.skipped] if self._head is not None else []
        return [x for xs in [*parts.values(), *head] for x in xs]

    def _received(self, skipped: list) -> None:
        self._skipped = {0: list(skipped)}  # a replica's: replica 0's, whole

    def _collect_live_stats(self) -> None:
        pipeline = self._live
        if pipeline is not None:
            self._stats[0] = pipeline.stats()
            self._skipped[0] = pipeline.skipped()

    def _from_workers(self) -> Iterator[WorkerBatch]:
        left = self._steps_left()
        if left == 0:
            return
        # read here, not from the loader as the items are handed out: with a device feed this
        # generator runs ahead of the training thread, which commits each item's state
        states, batch = list(self.clock.worker_states), self.clock.batch
        self._head = None
        item = self._head_start(states, batch)
        yield item
        states[item.logical] = item.state
        left = None if left is None else left - 1
        if left == 0:
            return
        job = self.job(states, batch + 1)
        yield from process_batches(job, self.num_workers, left, self.prefetch_factor, self.multiprocessing_context)

    def _head_start(self, states: list[dict | None], batch: int) -> WorkerBatch:
        """The iteration's first batch, built in this process by its logical worker's pipeline
        (restored from its state) while no worker process runs yet. The pipeline reads without
        read-ahead, so no thread of it is alive when the workers are forked; its storage
        counters are kept apart (``_head``) and added to the workers' in ``stats()``."""
        dataset = self.dataset.with_storage(dataclasses.replace(self.dataset.storage, prefetch_bytes=0))
        logical = batch % self.num_logical
        pipeline = self.job(states, batch, dataset).pipeline(logical)
        try:
            step = pipeline.step
            rows = pipeline.next_batch(self.batch_sizes.at(step))
            if rows is None:
                raise PipelineInvariantError(f"worker {logical} ended before its share of pass {self.clock.pass_idx}")
            self._head = WorkerBatch(logical, step, None, None, pipeline.stats(), pipeline.skipped())
            return WorkerBatch(logical, step, rows, pipeline.state_dict())
        finally:
            self.dataset.close_head_start(pipeline)  # no thread of it left for the fork

    def _finish(self, rows: RowBatch) -> dict[str, torch.Tensor]:
        batch = expand(rows, boundary=self.boundary, provenance=self.provenance, fields=self.fields)
        if self.pin_memory:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        if self.device.type != "cpu":
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return batch
