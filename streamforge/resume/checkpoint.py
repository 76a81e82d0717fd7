"""The loader's checkpoints: its global state, and the three ways a resume continues.

``StreamingLoader`` takes these methods from ``Checkpointing``; they read and set the
loader's clock (``_pass``, ``_first_step``, ``_batch``), its per-worker states and counters.

* ``state_dict``: the job's state (``state.py``), gathered across ranks at checkpoint time;
* ``load_state_dict``: exact when the job matches; elastic when only the topology or batch
  size changed (``elastic.py``); statistical otherwise (``resume.py``), with bounds;
* ``resume_from_counters``: a statistical start from token counts alone.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Mapping

import torch

from ..loader.counters import spread
from .elastic import elastic_blockers, remaining_plan, work_left, work_tokens
from ..errors import ConfigError, ResumeMismatchError
from ..planning.plan import PassPlan
from .statistical import statistical_bounds, statistical_worker_states, stream_positions
from ..planning.schedule import SkipRanges
from .state import STATE_VERSION, UNDIGESTED_VERSION, ResumeReport, config_differences, pack_state, saved_ranks, unpack_state

log = logging.getLogger("streamforge.loader")


class Checkpointing:
    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The job's state after the last batch handed out (``state.py``): the same dict on
        every rank under torch.distributed (the ranks' cursors are all-gathered here, at
        checkpoint time only, so every rank must call it); without a process group, it holds
        this rank's part only (``merge_states`` joins the ranks')."""
        self._refuse_state()
        if self._ledger is not None:  # a checkpoint never lacks its steps in the ledger
            self._ledger.flush()
        counters = self._counters.state_dict()
        pass_idx, first_step, batch = self._pass, self._first_step, self._batch
        workers, pass_tokens, remaining = self._worker_states, self._pass_tokens, self._remaining
        if self._pass_over():  # the next pass's start, as _end_pass will make it: a getter changes nothing
            pass_idx, first_step, dropped = self._next_pass()
            batch, workers, pass_tokens, remaining = 0, [None] * self.num_logical, 0, None
            counters["dropped_tokens"] += dropped
        part = {
            "rank": self.dataset.rank, "workers": workers, "pass_tokens": pass_tokens,
            "counters": counters, "skipped": self.skipped(),
        }
        return pack_state({
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint,
            "config": self._config,
            "world_size": self.dataset.world_size,
            "workers_per_rank": self.num_logical,
            "batch_size": self.batch_size,
            "step": first_step + batch,
            "pass": pass_idx,
            "pass_first_step": first_step,
            "batch": batch,
            "skip_steps": self.skip_steps.to_list(),
            "remaining": remaining,
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
        undigested = state.pop("undigested", False)
        before = dict(self.__dict__), copy.deepcopy(self._counters), self.dataset.resume_generation
        try:
            self._load(state, strict, mode)
        except BaseException as exc:  # a refused state leaves the loader as it was
            self.__dict__.clear()
            self.__dict__.update(before[0])
            self._counters, self.dataset.resume_generation = before[1], before[2]
            if isinstance(exc, (KeyError, TypeError, IndexError, AttributeError)) or (
                    type(exc) is ValueError):
                raise ResumeMismatchError(
                    f"loader state: a malformed value ({type(exc).__name__}: {exc}); the state was not applied"
                ) from exc
            raise
        if undigested:
            self.resume_report.approximations.append(
                f"a version-{UNDIGESTED_VERSION} state has no digest: its values were checked, but a change "
                "to its cursors could not be detected")
        self._ledger_restart()

    def _load(self, state: dict[str, Any], strict: bool, mode: str | None) -> None:
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
            return
        self._counters.load_state_dict(spread([state["ranks"][r]["counters"] for r in have], self.dataset.world_size))
        blockers = ([differences[0]] if state.get("upgraded_from") else ["mode='statistical' was asked for"]) if mode \
            else elastic_blockers(self.dataset, state, differences)
        if not blockers:
            self._load_elastic(state, differences)
        else:
            self._load_statistical(state, differences or ["mode='statistical' was asked for"], blockers)

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
                self.dataset.keep_indexes(pipeline.sources)  # for the head start and the workers
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
