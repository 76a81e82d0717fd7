"""StreamingLoader: a rank's batches on the job clock, with resumable state.

Each of the W logical workers of a rank runs one ``WorkerPipeline`` and builds whole batches
(``RowBatch``, ~2 bytes per token) that cross the process boundary in one buffer; this
process expands them into the batch contract, pins them and moves them to the device.

The clock. The rank's local batch ``i`` of a pass comes from logical worker ``i % W`` and has
global step ``pass_first_step + i`` (``plan.PassPlan``): the same number on every rank. A
finite pass has ``steps_per_pass`` steps on every rank, computed from the corpus metadata
before the first batch; each worker builds exactly its share of them, all full. Steps in
``skip_steps`` are built (their data consumed) and dropped here.

Order and state. A worker whose share is done answers with an end marker instead of
stopping, so torch's round-robin never reshuffles. The loader keeps, per logical worker, the
pipeline state sent along with the last batch *handed to the caller* (batches still
prefetched in workers do not count). On resume, DataLoader worker ``k`` plays logical worker
``(k + i) % W`` so the first batch comes from the right one.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from . import ledger
from .batch import RowBatch, expand
from .counters import Counters
from .dataset import PackedTokenDataset
from .device import DeviceFeed, check_depth, default_device
from .errors import ConfigError, ResumeMismatchError
from .plan import PassPlan
from .resume import statistical_bounds, statistical_worker_states, stream_positions
from .schedule import SkipRanges
from .counters import spread
from .elastic import elastic_blockers, remaining_plan, work_left, work_tokens
from .state import STATE_VERSION, ResumeReport, config_differences, fingerprint, pack_state, saved_ranks, unpack_state

log = logging.getLogger(__name__)


def _identity(item):
    return item


class _WorkerBatches(IterableDataset):
    """What runs inside each DataLoader worker process."""

    def __init__(self, job: "_Job") -> None:
        self.job = job

    def __iter__(self):
        job = self.job
        logical = (get_worker_info().id + job.rotation) % job.num_logical
        pipeline = job.pipeline(logical)
        try:
            while True:
                step = pipeline.step
                rows = pipeline.next_batch(job.batch_size)
                if rows is None:
                    break
                yield ("batch", logical, step, rows, pipeline.state_dict(), pipeline.stats(), pipeline.skipped())
        finally:
            pipeline.close()
        while True:  # keep torch's round-robin fixed: answer, never stop
            yield ("end", logical, None, None, None, None, None)


class StreamingLoader:
    """Iterable of batches (dicts of tensors) on the job clock, with exact
    ``state_dict``/``load_state_dict``.

    ``device`` (default: the rank's CUDA device, else the CPU) is where batches arrive;
    ``device_prefetch`` batches (default 2 on CUDA, 0 elsewhere) are expanded, pinned and
    copied ahead on a background thread (``device.DeviceFeed``).

    ``skip_steps=[(start, end), ...]`` drops the batches of those global steps (end
    exclusive), e.g. to jump over a loss spike; it can be given when resuming.

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
        self.device = default_device() if device is None else torch.device(device)
        self.device_prefetch = check_depth(device_prefetch, self.device)  # batches in flight (device.py)
        self.pin_memory = (self.device.type == "cuda") if pin_memory is None else bool(pin_memory)
        self.skip_steps = SkipRanges(skip_steps)
        if dataset.evaluation and self.skip_steps:
            raise ConfigError("skip_steps does not apply to an evaluation loader: its pass holds every held-out token")
        self.resume_report: ResumeReport | None = None
        self._config = {**dataset.describe(), "batch_size": self.batch_size, "workers_per_rank": self.num_logical}
        self._fingerprint = fingerprint(self._config)
        self._live = None  # the in-process pipeline while one is iterating
        self._stats: dict[int, dict] = {}
        self._skipped: dict[int, list] = {}
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

    def _end_pass(self) -> None:
        plan = self.plan()
        self._counters.dropped_tokens += max(0, plan.rank_tokens(self.dataset.rank) - self._pass_tokens)
        self._start_pass(self._pass + 1, self._first_step + plan.steps)

    def _pass_over(self) -> bool:
        """All of the pass's steps were handed out (an empty pass is over once iterated)."""
        return not self.infinite and 0 < self._batch and self._batch >= self.plan().steps

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The job's state after the last batch handed out (``state.py``): the same dict on
        every rank under torch.distributed (the ranks' cursors are all-gathered here, at
        checkpoint time only, so every rank must call it); without a process group, it holds
        this rank's part only (``merge_states`` joins the ranks')."""
        self._refuse_state()
        if self._pass_over():
            self._end_pass()
        if self._ledger is not None:  # a checkpoint never lacks its steps in the ledger
            self._ledger.flush()
        part = {
            "rank": self.dataset.rank, "workers": self._worker_states, "pass_tokens": self._pass_tokens,
            "counters": self._counters.state_dict(), "skipped": self.skipped(),
        }
        return pack_state({
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint,
            "config": self._config,
            "world_size": self.dataset.world_size,
            "workers_per_rank": self.num_logical,
            "batch_size": self.batch_size,
            "step": self.step,
            "pass": self._pass,
            "pass_first_step": self._first_step,
            "batch": self._batch,
            "skip_steps": self.skip_steps.to_list(),
            "remaining": self._remaining,
            "generation": self.dataset.resume_generation,
            "ranks": _gather(part, self.dataset.rank, self.dataset.world_size),
        })

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = False, mode: str | None = None) -> None:
        """Continue from ``state`` (``resume_report`` says how and why):

        * ``exact`` when the job matches: the next batches are the uninterrupted run's;
        * ``elastic`` when only the world size, workers per rank or batch size changed: the
          rest of the pass is re-planned over this topology, every token not yet delivered
          exactly once (``elastic.py``);
        * ``statistical`` otherwise (or with ``mode="statistical"``): each stream continues
          at the same fraction of its pass, with bounds on what may repeat or be skipped.

        ``strict=True`` raises ``ResumeMismatchError`` unless the resume is exact."""
        self._refuse_state()
        if mode not in (None, "statistical"):
            raise ConfigError(f"mode must be None (the best the state allows) or 'statistical', got {mode!r}")
        state = copy.deepcopy(unpack_state(state))
        self.skip_steps = self.skip_steps | SkipRanges(state["skip_steps"])
        differences = self._differences(state)
        if state.get("upgraded_from"):
            differences.insert(0, f"state version {state['upgraded_from']} (one rank's state, from an older "
                                  "streamforge): resumed statistically from that rank's cursors")
            mode = "statistical"
        if strict and differences:
            raise ResumeMismatchError("the resume would not be exact: " + "; ".join(differences))
        have = saved_ranks(state)
        if not have:
            raise ResumeMismatchError("loader state holds no rank's part")
        if not differences and mode is None:
            part = state["ranks"][self.dataset.rank]
            if part is None:
                raise ResumeMismatchError(
                    f"this state holds the part of rank(s) {have} of {state['world_size']}, not of rank "
                    f"{self.dataset.rank}: save under torch.distributed (state_dict() gathers every rank's "
                    "part) or join the ranks' states with streamforge.merge_states"
                )
            self._counters.load_state_dict(part["counters"])
            self._load_exact(state, part)
            self._ledger_restart()
            return
        self._counters.load_state_dict(spread([state["ranks"][r]["counters"] for r in have], self.dataset.world_size))
        blockers = ([differences[0]] if state.get("upgraded_from") else ["mode='statistical' was asked for"]) if mode \
            else elastic_blockers(self.dataset, state, differences)
        if not blockers:
            self._load_elastic(state, differences)
        else:
            self._load_statistical(state, differences or ["mode='statistical' was asked for"], blockers)
        self._ledger_restart()

    def _ledger_restart(self) -> None:
        if self._ledger is not None:
            self._ledger.start_generation(self.step, self.resume_report.mode)

    def _refuse_state(self) -> None:
        if self.evaluation:
            raise ConfigError(
                "an evaluation loader has no state to save or load: every iteration replays the same "
                "batches from the top (see docs/eval.md)"
            )

    def _differences(self, state: dict[str, Any]) -> list[str]:
        """Why ``state`` cannot resume exactly here (empty: it can)."""
        differences = config_differences(state["config"], self._config)
        if not differences and state["fingerprint"] != self._fingerprint:
            differences = [f"fingerprint {state['fingerprint']} != {self._fingerprint}"]
        return differences

    def _load_exact(self, state: dict[str, Any], part: dict[str, Any]) -> None:
        self._start_pass(int(state["pass"]), int(state["pass_first_step"]))
        self.dataset.resume_generation = int(state["generation"])
        self._remaining = state["remaining"]
        self._batch = int(state["batch"])
        self._pass_tokens = int(part["pass_tokens"])
        workers = part["workers"]
        if len(workers) != self.num_logical:
            raise ResumeMismatchError(f"loader state has {len(workers)} worker states, this loader {self.num_logical}")
        if self._remaining is not None:
            self._plan = self._remaining_plan(self._remaining)
        steps = self.plan().steps
        if not self.infinite and not 0 <= self._batch <= steps:
            raise ResumeMismatchError(f"loader state: batch {self._batch} is outside pass {self._pass} of {steps} steps")
        self._check_workers(workers)
        self._worker_states = workers
        self.resume_report = ResumeReport(
            "exact",
            f"step {self.step} (pass {self._pass}, batch {self._batch}): every stage restored from its "
            "cursor; the next batches are those of the uninterrupted run",
            skipped=part["skipped"],
        )

    def _check_workers(self, workers: list) -> None:
        """Every worker state points into this rank's data (``ResumeMismatchError`` if not)."""
        for w, worker_state in enumerate(workers):
            if worker_state is None:
                continue
            pipeline = self.dataset.make_pipeline(
                w, self.num_logical, first_pass=self._pass, quota=self._quotas()[w] if not self.infinite else None,
                first_step=self.plan().first_step, plan=self._work_plan(),
            )
            try:
                pipeline.check_state(worker_state)
            finally:
                pipeline.close()

    def _load_elastic(self, state: dict[str, Any], differences: list[str]) -> None:
        step = int(state["step"])
        work = work_left(self.dataset, state)
        self.dataset.resume_generation = int(state["generation"])
        self._start_pass(int(work["pass"]), step)
        self._remaining = {"work": work}
        self._plan = self._remaining_plan(self._remaining)
        plan = self._plan
        left = work_tokens(self.dataset, work)
        names = self.dataset.stream_names
        old = f"{state['world_size']} rank(s) x {state['workers_per_rank']} worker(s), batch {state['batch_size']}"
        new = f"{self.dataset.world_size} rank(s) x {self.num_logical} worker(s), batch {self.batch_size}"
        notes = [
            f"stream {n!r}: {t:,} tokens left in pass {self._pass} ({len(w['ranges'])} record ranges, "
            f"{len(w['windows'])} saved shuffle windows' rests, the packer's carry included)"
            for n, t, w in zip(names, left, work["streams"])
        ]
        notes.append(f"the rest of pass {self._pass}: {plan.steps} steps on every rank from step {step}; tokens "
                     f"past its last full step are not delivered, at most {plan.drop_bound():,} (the drop bound)")
        have = saved_ranks(state)
        notes.append(f"the job's counters carry over: summed over the {len(have)} saved ranks, shared evenly "
                     f"among {self.dataset.world_size}")
        log.warning("streamforge: elastic resume at step %d: %s -> %s", step, old, new)
        self.resume_report = ResumeReport(
            "elastic",
            f"step {step}: the rest of pass {self._pass} re-planned from {old} to {new}; every token of the pass "
            "not yet delivered comes exactly once (documents in shuffle windows and the packer's carry "
            "included); the order differs from the uninterrupted run's",
            differences=differences,
            approximations=notes,
            skipped=[item for r in have for item in state["ranks"][r]["skipped"]],
        )

    def _load_statistical(self, state: dict[str, Any], differences: list[str], why: list[str]) -> None:
        positions, notes = stream_positions(self.dataset, state)
        notes.insert(0, "not elastic: " + "; ".join(why))
        bounds = statistical_bounds(self.dataset, state, positions, self.num_logical)
        have = saved_ranks(state)
        notes.append(f"the job's counters carry over: summed over the {len(have)} saved rank(s) {have}, "
                     f"shared evenly among {self.dataset.world_size}")
        self._start_statistical(
            positions, int(state["step"]), int(state["generation"]) + 1, notes, bounds, differences,
            "the saved cursors cannot be replayed exactly here; continuing from the same position "
            "in each stream's pass with the same mixture and step",
            [item for r in have for item in state["ranks"][r]["skipped"]],
        )

    def _start_statistical(self, positions, step: int, generation: int, notes: list[str], bounds,
                           differences: list[str], summary: str, skipped: list) -> None:
        """Start every worker ``positions`` into its ranges of the new plan, at ``step``."""
        self.dataset.resume_generation = generation
        notes.append(f"the windows are reshuffled: resume generation {generation}")
        self._start_pass(min((p for p, _ in positions), default=0), step)
        self._remaining = {"fractions": [f if p == self._pass else 1.0 for p, f in positions]}
        for name, bound in zip(self.dataset.stream_names, bounds):
            if bound is not None:
                notes.append(f"stream {name!r}: at most {bound[0]:,} records may be seen twice and {bound[1]:,} "
                             f"skipped in pass {self._pass} (records read before the save, in shuffle windows "
                             "or the packer's carry, against where the new workers start)")
        self._worker_states = statistical_worker_states(self.dataset, positions, self.num_logical)
        if not self.infinite:
            self._plan = self._remaining_plan(self._remaining)
            notes.append(f"the rest of pass {self._pass} has {self._plan.steps} steps on every rank, "
                         f"from step {step}")
        log.warning("streamforge: statistical resume at step %d: %s", step, "; ".join(differences))
        self.resume_report = ResumeReport("statistical", summary, differences=differences,
                                          approximations=notes, skipped=skipped)

    def resume_from_counters(self, tokens_seen: Mapping[str, float], *, step: int | None = None) -> None:
        """Continue a job whose only record is the tokens it saw per stream (e.g. from its
        logs): each stream starts that far into its passes, statistically, the counters carry
        those totals, and the windows are reshuffled. ``step`` defaults to the tokens seen over
        the tokens one step delivers. Streams left out count as unseen."""
        self._refuse_state()
        names = self.dataset.stream_names
        unknown = sorted(set(tokens_seen) - set(names))
        if unknown:
            raise ConfigError(f"resume_from_counters: no stream named {unknown}; the streams are {names}")
        per_pass = work_tokens(self.dataset, {"streams": [
            {"ranges": [[k, 0, int(m.columns["num_records"][k])] for k in range(m.num_shards)], "windows": []}
            for m in self.dataset.manifests]})
        positions, notes = [], []
        for name, total in zip(names, per_pass):
            seen = float(tokens_seen.get(name, 0))
            if seen < 0:
                raise ConfigError(f"resume_from_counters: stream {name!r} saw {seen} tokens: must be >= 0")
            pass_idx, into = divmod(seen, total) if total else (0, 0.0)
            positions.append((int(pass_idx), into / total if total else 0.0))
            notes.append(f"stream {name!r}: {seen:,.0f} tokens seen: pass {int(pass_idx)}, "
                         f"{positions[-1][1]:.1%} into it (a pass holds {total:,} tokens)")
        if not self.infinite:  # one pass for the job: a stream past it has that pass done
            first = min(p for p, _ in positions)
            positions = [(first, f if p == first else 1.0) for p, f in positions]
        if step is None:
            per_step = self.dataset.world_size * self.batch_size * self.dataset.config.seq_len
            step = int(round(sum(float(v) for v in tokens_seen.values()) / per_step))
            notes.append(f"step {step} estimated from the tokens seen ({per_step:,} tokens per step)")
        self._counters.set_tokens([float(tokens_seen.get(n, 0)) / self.dataset.world_size for n in names])
        self._start_statistical(
            positions, int(step), self.dataset.resume_generation + 1, notes, [None] * len(names),
            ["resumed from token counts only"],
            "no cursor to replay: each stream continues at the fraction of its pass that the tokens "
            "seen give, with the same mixture and step", [],
        )

    def _remaining_plan(self, remaining: dict[str, Any]) -> PassPlan:
        if "work" in remaining:  # every rank computes it from the same global state: no agreement needed
            return remaining_plan(
                self.dataset, remaining["work"], world_size=self.dataset.world_size,
                workers_per_rank=self.num_logical, batch_size=self.batch_size, first_step=self._first_step,
            )
        plan = self.dataset.pass_plan(
            self._pass, workers_per_rank=self.num_logical, batch_size=self.batch_size,
            first_step=self._first_step, fractions=remaining["fractions"],
        )
        plan.steps = _agree_min(plan.steps, self.device)
        return plan

    def _work_plan(self) -> PassPlan | None:
        """The plan workers must follow to read their ranges: an evaluation pass's, or the
        rest of a pass after an elastic resume; None when the planner's own ranges apply."""
        if self.evaluation:
            return self.plan()
        if self._remaining is not None and "work" in self._remaining and not self.infinite:
            return self.plan()
        return None

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
        for worker_stats in self._stats.values():
            _accumulate(storage, worker_stats)
        _ratios(storage)
        for name in self.dataset.stream_names:
            out["streams"][name].update(storage.pop(name, {}))
        out.update(storage)
        return out

    def skipped(self) -> list[dict[str, Any]]:
        self._collect_live_stats()
        return [item for items in self._skipped.values() for item in items]

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.evaluation:  # every iteration is the same pass, from the top
            plan = self._plan
            self._start_pass(0, 0)
            self._plan = plan
            self._counters = Counters(self.dataset.stream_names, self.dataset.schedule)
            self._stats.clear()
        elif self._pass_over():
            self._end_pass()
        items = self._in_process() if self.num_workers == 0 else self._from_workers()
        skips = self.skip_steps if self.skip_steps else None
        feed = DeviceFeed(self._finish, self.device, self.device_prefetch)
        for logical, step, rows, state, stats, skipped in feed.items(items):
            if step != self._first_step + self._batch:
                raise RuntimeError(f"worker {logical} built step {step}, the loader expected {self.step}")
            self._worker_states[logical] = state
            if stats is not None:  # workers send their counters with every batch
                self._stats[logical] = stats
                self._skipped[logical] = skipped
            self._batch += 1
            num_tokens = int(rows.length.sum())
            self._pass_tokens += num_tokens
            if self._ledger is not None:
                self._ledger.add(step, self._pass, rows, skipped=skips is not None and step in skips)
            if skips is not None and step in skips:
                self._counters.skip(num_tokens)
                continue
            self._counters.add(rows, step, num_tokens)
            yield feed.hand_out()  # the state above is this batch's: committed as it is handed out
        if not self.infinite and not self.evaluation:
            self._end_pass()
        if self._ledger is not None:
            self._ledger.flush()

    def _job(self, states):
        plan = None if self.infinite else self.plan()
        return _Job(
            self.dataset, self.num_logical, self._pass, 0 if plan is None else plan.first_step,
            None if plan is None else self._quotas(), states, self._batch % self.num_logical, self.batch_size,
            self._work_plan(),
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
        loader = DataLoader(
            _WorkerBatches(self._job(self._worker_states)), batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
            prefetch_factor=self.prefetch_factor, multiprocessing_context=self.multiprocessing_context,
        )
        iterator = iter(loader)
        try:
            while left is None or left > 0:
                kind, logical, step, rows, state, stats, skipped = next(iterator)
                if kind == "end":
                    raise RuntimeError(f"worker {logical} ended before its share of pass {self._pass}")
                left = None if left is None else left - 1
                yield logical, step, rows, state, stats, skipped
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


@dataclass
class _Job:
    """What a worker needs to build its share of the pass (pickled to worker processes)."""

    dataset: PackedTokenDataset
    num_logical: int
    pass_idx: int
    first_step: int
    quotas: list[int] | None
    states: list[dict | None]
    rotation: int
    batch_size: int
    plan: Any = None  # an evaluation pass's plan (its rows are dealt in it)

    def pipeline(self, logical: int):
        """Logical worker ``logical``'s pipeline, restored from its saved state if any."""
        pipeline = self.dataset.make_pipeline(
            logical, self.num_logical, first_pass=self.pass_idx,
            quota=None if self.quotas is None else self.quotas[logical], first_step=self.first_step,
            plan=self.plan,
        )
        if self.states[logical] is not None:
            try:
                pipeline.load_state_dict(self.states[logical])
            except BaseException:
                pipeline.close()
                raise
        return pipeline


def _gather(part: dict[str, Any], rank: int, world_size: int) -> list[dict[str, Any] | None]:
    """Every rank's part under torch.distributed (one all-gather); else this rank's alone."""
    dist = torch.distributed
    if world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size:
        parts: list[Any] = [None] * world_size
        dist.all_gather_object(parts, part)
        return parts
    parts = [None] * world_size
    parts[rank] = part
    return parts


def _agree_min(value: int, device: torch.device) -> int:
    """The minimum of ``value`` over ranks when a process group exists (one all-reduce at
    resume time, never per step); ``value`` otherwise."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


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
