"""The loader's checkpointer: the job's state, and the three ways a resume continues.

``Checkpointer`` belongs to one ``StreamingLoader``; it reads the loader's ``Clock`` (pass,
first step, batch, worker states) and counters to save, and sets them to resume:

* ``save``: the job's state (``state.py``), gathered across ranks at checkpoint time; it
  changes nothing, at any step (at a pass's last step it describes the next pass's start);
* ``load``: exact when the job matches; elastic when only the topology or batch size changed
  (``elastic.py``); statistical otherwise (``statistical.py``), with bounds. A refused state
  leaves the loader as it was;
* ``resume_from_counters``: a statistical start from token counts alone.
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any, Mapping

from ..errors import ConfigError, ResumeMismatchError
from ..loader.clock import PassRest
from ..loader.counters import spread
from ..loader.membership import KIND as MEMBERSHIP, Membership
from ..planning.plan import PassPlan
from ..planning.schedule import SkipRanges
from ..planning.steps import step_at_tokens
from .cut_work import use_loader_cuts, use_saved_cuts
from .elastic import dealt_here, elastic_blockers, remaining_plan, work_left, work_tokens
from .state import (
    STATE_VERSION, UNDIGESTED_VERSION, ResumeReport, config_differences, config_fingerprint, pack_state,
    saved_ranks, unpack_state,
)
from .statistical import statistical_bounds, statistical_worker_states, stream_positions

log = logging.getLogger("streamforge.loader")


class Checkpointer:
    """Saves and restores one loader's place in the job.

    Args:
        loader: the ``StreamingLoader`` it belongs to; it reads and sets the loader's
            ``clock``, ``counters``, ``skip_steps`` and ``resume_report``.
    """

    def __init__(self, loader: Any) -> None:  # a StreamingLoader (which imports this module)
        # a proxy, not a reference: the loader holds its checkpointer, and a loader dropped by
        # the trainer is freed (its ledger flushed) at once, not at the next collection
        self.loader = weakref.proxy(loader)
        self.dataset = loader.dataset

    # -- save ------------------------------------------------------------------------------
    def save(self) -> dict[str, Any]:
        """The job's state after the last batch handed out (``state.py``); changes nothing."""
        loader, clock = self.loader, self.loader.clock
        self._refuse_state()
        if loader.membership is not None and loader.membership.active:  # the history, the same everywhere
            return loader.membership.state_dict()
        if loader.ledger is not None:  # a checkpoint never lacks its steps in the ledger
            loader.ledger.flush()
        counters = loader.counters.state_dict()
        pass_idx, first_step, batch = clock.pass_idx, clock.first_step, clock.batch
        workers, pass_tokens = clock.worker_states, clock.pass_tokens
        rest = None if clock.rest is None else clock.rest.to_state()
        if loader.pass_over():  # the next pass's start, as the loader will make it
            pass_idx, first_step, dropped = loader.next_pass()
            batch, workers, pass_tokens, rest = 0, [None] * loader.num_logical, 0, None
            counters["dropped_tokens"] += dropped
        part = {
            "rank": self.dataset.rank, "workers": workers, "pass_tokens": pass_tokens,
            "counters": counters, "skipped": loader.skipped(),
        }
        return pack_state({
            "version": STATE_VERSION,
            "fingerprint": loader.fingerprint,
            "config": loader.config,
            "world_size": self.dataset.world_size,
            "workers_per_rank": loader.num_logical,
            "batch_size": loader.batch_size,
            "step": first_step + batch,
            "pass": pass_idx,
            "pass_first_step": first_step,
            "batch": batch,
            "skip_steps": loader.skip_steps.to_list(),
            "remaining": rest,
            "generation": self.dataset.resume_generation,
            "ranks": self.dataset.topology.gather(part),
        })

    # -- load ------------------------------------------------------------------------------
    def load(self, state: dict[str, Any], *, strict: bool = False, mode: str | None = None) -> None:
        """Continue from ``state`` (``StreamingLoader.load_state_dict`` says how)."""
        loader = self.loader
        self._refuse_state()
        if isinstance(state, Mapping) and state.get("kind") == MEMBERSHIP:  # loader/membership.py
            Membership.of(loader).load_state_dict(dict(state))
            self._ledger_restart()
            return
        if mode not in (None, "statistical"):
            raise ConfigError(f"mode must be None (the best the state allows) or 'statistical', got {mode!r}")
        state = copy.deepcopy(unpack_state(state))
        undigested = state.pop("undigested", False)
        before = (copy.copy(loader.clock), loader.counters.totals, loader.skip_steps, loader.resume_report,
                  self.dataset.resume_generation)
        try:
            self._load(state, strict, mode)
        except BaseException as exc:  # a refused state leaves the loader as it was
            (loader.clock, loader.counters.totals, loader.skip_steps, loader.resume_report,
             self.dataset.resume_generation) = before
            if isinstance(exc, (KeyError, TypeError, IndexError, AttributeError)) or (
                    type(exc) is ValueError):
                raise ResumeMismatchError(
                    f"loader state: a malformed value ({type(exc).__name__}: {exc}); the state was not applied"
                ) from exc
            raise
        if undigested:
            loader.resume_report.approximations.append(
                f"a version-{UNDIGESTED_VERSION} state has no digest: its values were checked, but a change "
                "to its cursors could not be detected")
        self._ledger_restart()

    def _load(self, state: dict[str, Any], strict: bool, mode: str | None) -> None:
        loader = self.loader
        loader.skip_steps = loader.skip_steps | SkipRanges(state["skip_steps"])
        differences = self._differences(state)
        forced = None  # why only a statistical resume can read this state
        if state.get("upgraded_from"):
            forced = (f"state version {state['upgraded_from']} (one rank's state, from an older streamforge): "
                      "resumed statistically from that rank's cursors")
        elif not dealt_here(state):
            forced = ("its pass was re-planned elastically by an older streamforge, which dealt saved shuffle "
                      "windows whole (remaining.work has no 'deal'); this one cannot rebuild that plan to read "
                      "the workers' cursors against it: resumed statistically")
        if forced:
            differences.insert(0, forced)
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
            loader.counters.load_state_dict(part["counters"])
            self._load_exact(state, part)
            return
        loader.counters.load_state_dict(spread([state["ranks"][r]["counters"] for r in have], self.dataset.world_size))
        blockers = ([forced] if forced else ["mode='statistical' was asked for"]) if mode \
            else elastic_blockers(self.dataset, state, differences)
        if not blockers:
            self._load_elastic(state, differences)
        else:
            self._load_statistical(state, differences or ["mode='statistical' was asked for"], blockers)

    def _ledger_restart(self) -> None:
        if self.loader.ledger is not None:
            report = self.loader.resume_report  # (none for a participant restored before it is live)
            self.loader.ledger.start_generation(self.loader.step, "membership" if report is None else report.mode)

    def _refuse_state(self) -> None:
        if self.loader.evaluation:
            raise ConfigError(
                "an evaluation loader has no state to save or load: every iteration replays the same "
                "batches from the top (see docs/eval.md)"
            )

    def _differences(self, state: dict[str, Any]) -> list[str]:
        """Why ``state`` cannot resume exactly here (empty: it can)."""
        differences = config_differences(state["config"], self.loader.config)
        saved = config_fingerprint(state["config"])  # the digest vouches for the saved config
        if not differences and saved != self.loader.fingerprint:
            differences = [f"fingerprint {saved} != {self.loader.fingerprint}"]
        return differences

    def _load_exact(self, state: dict[str, Any], part: dict[str, Any]) -> None:
        loader, clock = self.loader, self.loader.clock
        clock.start(int(state["pass"]), int(state["pass_first_step"]), PassRest.from_state(state["remaining"]))
        self.dataset.resume_generation = int(state["generation"])
        clock.batch = int(state["batch"])
        clock.pass_tokens = int(part["pass_tokens"])
        workers = part["workers"]
        if len(workers) != loader.num_logical:
            raise ResumeMismatchError(f"loader state has {len(workers)} worker states, this loader {loader.num_logical}")
        if clock.rest is not None:
            clock.plan = self._rest_plan(clock.rest)
        steps = loader.plan().steps
        if not loader.infinite and not 0 <= clock.batch <= steps:
            raise ResumeMismatchError(
                f"loader state: batch {clock.batch} is outside pass {clock.pass_idx} of {steps} steps")
        self._check_workers(workers)
        clock.worker_states = workers
        loader.resume_report = ResumeReport(
            "exact",
            f"step {loader.step} (pass {clock.pass_idx}, batch {clock.batch}): every stage restored from its "
            "cursor; the next batches are those of the uninterrupted run",
            skipped=part["skipped"],
        )

    def _check_workers(self, workers: list) -> None:
        """Every worker state points into this rank's data (``ResumeMismatchError`` if not)."""
        for w, worker_state in enumerate(workers):
            if worker_state is None:
                continue
            loader = self.loader
            pipeline = self.dataset.make_pipeline(
                w, loader.num_logical, first_pass=loader.clock.pass_idx,
                quota=loader.quotas()[w] if not loader.infinite else None,
                first_step=loader.plan().first_step, plan=loader.work_plan(),
            )
            try:
                pipeline.check_state(worker_state)
                self.dataset.keep_indexes(pipeline.sources)  # for the head start and the workers
            finally:
                pipeline.close()

    def _load_elastic(self, state: dict[str, Any], differences: list[str]) -> None:
        loader, clock = self.loader, self.loader.clock
        step = int(state["step"])
        work = work_left(self.dataset, state)
        use_loader_cuts(self.dataset, self.loader)  # token cuts: this topology's again
        self.dataset.resume_generation = int(state["generation"])
        clock.start(int(work["pass"]), step, PassRest(work=work))
        plan = clock.plan = self._rest_plan(clock.rest)
        left = work_tokens(self.dataset, work)
        names = self.dataset.stream_names
        old = (f"{state['world_size']} rank(s) x {state['workers_per_rank']} worker(s), batch "
               f"{state['config'].get('batch_size', state['batch_size'])}")  # a schedule: [[step, rows], ...]
        new = f"{self.dataset.world_size} rank(s) x {loader.num_logical} worker(s), batch {loader.config['batch_size']}"
        notes = [
            f"stream {n!r}: {t:,} tokens left in pass {clock.pass_idx} ({len(w['ranges'])} record ranges, "
            f"{len(w['windows'])} saved shuffle windows' rests, the packer's carry included)"
            for n, t, w in zip(names, left, work["streams"])
        ]
        notes.append(f"the rest of pass {clock.pass_idx}: {plan.steps} steps on every rank from step {step}; tokens "
                     f"past its last full step are not delivered, at most {plan.drop_bound():,} (the drop bound)")
        have = saved_ranks(state)
        notes.append(f"the job's counters carry over: summed over the {len(have)} saved ranks, shared evenly "
                     f"among {self.dataset.world_size}")
        log.warning("streamforge: elastic resume at step %d: %s -> %s", step, old, new)
        loader.resume_report = ResumeReport(
            "elastic",
            f"step {step}: the rest of pass {clock.pass_idx} re-planned from {old} to {new}; every token of the pass "
            "not yet delivered comes exactly once (documents in shuffle windows and the packer's carry "
            "included); the order differs from the uninterrupted run's",
            differences=differences,
            approximations=notes,
            skipped=[item for r in have for item in state["ranks"][r]["skipped"]],
        )

    def _load_statistical(self, state: dict[str, Any], differences: list[str], why: list[str]) -> None:
        use_saved_cuts(self.dataset, state)  # token cuts: the saved topology's, then this one's
        positions, notes = stream_positions(self.dataset, state)
        use_loader_cuts(self.dataset, self.loader)
        notes.insert(0, "not elastic: " + "; ".join(why))
        bounds = statistical_bounds(self.dataset, state, positions, self.loader.num_logical)
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
        loader, clock = self.loader, self.loader.clock
        self.dataset.resume_generation = generation
        notes.append(f"the windows are reshuffled: resume generation {generation}")
        pass_idx = min((p for p, _ in positions), default=0)
        clock.start(pass_idx, step, PassRest(fractions=[f if p == pass_idx else 1.0 for p, f in positions]))
        for name, bound in zip(self.dataset.stream_names, bounds):
            if bound is not None:
                notes.append(f"stream {name!r}: at most {bound[0]:,} records may be seen twice and {bound[1]:,} "
                             f"skipped in pass {clock.pass_idx} (records read before the save, in shuffle windows "
                             "or the packer's carry, against where the new workers start)")
        clock.worker_states = statistical_worker_states(self.dataset, positions, loader.num_logical)
        if not loader.infinite:
            clock.plan = self._rest_plan(clock.rest)
            notes.append(f"the rest of pass {clock.pass_idx} has {clock.plan.steps} steps on every rank, "
                         f"from step {step}")
        log.warning("streamforge: statistical resume at step %d: %s", step, "; ".join(differences))
        loader.resume_report = ResumeReport("statistical", summary, differences=differences,
                                            approximations=notes, skipped=skipped)

    def resume_from_counters(self, tokens_seen: Mapping[str, float], *, step: int | None = None) -> None:
        """A statistical start from the tokens seen per stream (``StreamingLoader.resume_from_counters``)."""
        loader = self.loader
        self._refuse_state()
        names = self.dataset.stream_names
        unknown = sorted(set(tokens_seen) - set(names))
        if unknown:
            raise ConfigError(f"resume_from_counters: no stream named {unknown}; the streams are {names}")
        planner = self.dataset.planner  # a pass: every reading of each stream (planning/readings.py)
        per_pass = work_tokens(self.dataset, {"streams": [
            {"ranges": [list(r) for r in planner.ranges(i, 0, 1)[0]], "windows": []}
            for i in range(len(self.dataset.streams))]})
        positions, notes = [], []
        for name, total in zip(names, per_pass):
            seen = float(tokens_seen.get(name, 0))
            if seen < 0:
                raise ConfigError(f"resume_from_counters: stream {name!r} saw {seen} tokens: must be >= 0")
            pass_idx, into = divmod(seen, total) if total else (0, 0.0)
            positions.append((int(pass_idx), into / total if total else 0.0))
            notes.append(f"stream {name!r}: {seen:,.0f} tokens seen: pass {int(pass_idx)}, "
                         f"{positions[-1][1]:.1%} into it (a pass holds {total:,} tokens)")
        if not loader.infinite:  # one pass for the job: a stream past it has that pass done
            first = min(p for p, _ in positions)
            positions = [(first, f if p == first else 1.0) for p, f in positions]
        if step is None:
            batch, seq = loader.batch_sizes, self.dataset.seq_lens
            step = step_at_tokens(batch, seq, sum(float(v) for v in tokens_seen.values()) / self.dataset.world_size)
            if batch.constant is not None and seq.constant is not None:
                how = f"{self.dataset.world_size * batch.constant * seq.constant:,} tokens per step"
            else:
                how = "the tokens of each step as the batch-size and seq_len schedules give them"
            notes.append(f"step {step} estimated from the tokens seen ({how})")
        loader.counters.set_tokens([float(tokens_seen.get(n, 0)) / self.dataset.world_size for n in names])
        self._start_statistical(
            positions, int(step), self.dataset.resume_generation + 1, notes, [None] * len(names),
            ["resumed from token counts only"],
            "no cursor to replay: each stream continues at the fraction of its pass that the tokens "
            "seen give, with the same mixture and step", [],
        )

    def _rest_plan(self, rest: PassRest) -> PassPlan:
        """The plan of what is left of the pass after a resume on another topology."""
        loader, clock = self.loader, self.loader.clock
        if rest.elastic:  # every rank computes it from the same global state: no agreement needed
            # token cuts: this topology's, as the re-plan was made (an exact resume of an
            # elastically resumed job has planned nothing yet)
            use_loader_cuts(self.dataset, loader)
            return remaining_plan(
                self.dataset, rest.work, world_size=self.dataset.world_size,
                workers_per_rank=loader.num_logical, batch_size=loader.batch_sizes, first_step=clock.first_step,
            )
        plan = self.dataset.pass_plan(
            clock.pass_idx, workers_per_rank=loader.num_logical, batch_size=loader.batch_sizes,
            first_step=clock.first_step, fractions=rest.fractions,
        )
        plan.steps = self.dataset.topology.agree_min(plan.steps, loader.device)
        return plan
