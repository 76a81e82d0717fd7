"""A running loader's live membership: ``StreamingLoader.set_membership`` and its state.

``set_membership(step, participants)`` records that from global ``step`` on, ``participants``
(their number, or the participants themselves with this one among them) are the live
data-parallel participants, and re-plans the pass at that step (``resume/membership.py``):
the loader's rank becomes this participant's position among the live ones, its plan the
segment's, and its worker cursors those every participant computes for it at that step from
the history and the record lengths (no peer's state). A change at the next step is applied
in flight: an iteration running is stopped after the batches handed out (its worker
processes closed, what they prefetched never counted) and restarted on the new plan at the
same step, within the same ``for`` loop. A change at the step of the batch handed out last
puts that batch back first: it is not counted as delivered (counters, clock, ledger) and the
new plan rebuilds that step.

The state of a loader with a membership is the history, the pass it applies to and the step:
small, and the same on every participant (``state_dict``); any participant resumes exactly
from it, its rank given by ``set_membership`` or the dataset's.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

from ..errors import ConfigError, ResumeMismatchError
from ..resume.membership import MembershipPlanner, check_history, count, live_at, member_dataset, with_change
from .clock import PassRest

KIND = "streamforge.membership"
VERSION = 1


class Membership:
    """The live membership of one ``StreamingLoader`` (``loader.membership``)."""

    def __init__(self, loader: Any) -> None:
        # a proxy, as the checkpointer's: a loader dropped by the trainer is freed (its ledger
        # flushed) at once, not at the next collection
        self.loader = loader if isinstance(loader, weakref.ProxyTypes) else weakref.proxy(loader)
        self.base = loader.dataset  # its topology: this participant's id among all
        self.history: list[tuple[int, int]] | None = None
        self.rank = self.base.rank
        self.planner: MembershipPlanner | None = None
        self._inner: Iterator | None = None
        self._before: tuple | None = None  # the loader as it was before the last batch handed out
        self._joining = False  # restored from a state where this participant is not live yet

    @classmethod
    def of(cls, loader: Any) -> Membership:
        """``loader.membership``, made on first use."""
        if loader.membership is None:
            loader.membership = cls(loader)
        return loader.membership

    @property
    def active(self) -> bool:
        """Has a membership been set (or restored)?"""
        return self.history is not None

    # -- changes ---------------------------------------------------------------------------
    def cursors(self) -> dict[str, Any]:
        """This participant's cursors at the loader's next step: what a peer passes to
        ``set_membership(..., cursors=)`` so as not to replay them (``{"step", "rank": its
        position among the live, "workers": its worker states}``)."""
        clock = self.loader.clock
        return {"step": clock.step, "rank": self.rank, "workers": list(clock.worker_states)}

    def set(self, step: int, participants: Any, rank: int | None = None, cursors: list | None = None) -> None:
        loader = self.loader
        if loader.evaluation or loader.infinite or loader.dataset.config.packing == "bestfit":
            raise ConfigError("set_membership: live membership re-plans a finite training pass in concat or pad "
                              "packing, as elastic resume does (not an evaluation loader, infinite=True nor "
                              "packing='bestfit')")
        if loader.shares_reads:
            raise ConfigError("set_membership: read_once replicas are not supported with a live membership")
        n = count(participants)
        rank = self._rank_of(participants, n, rank)
        step = int(step)
        now = loader.step
        if step == now - 1 and self._before is not None and self._before[0] == step:
            self._put_back()
        elif step != now:
            raise ConfigError(f"set_membership: step {step} is not the loader's next step {now} (nor the step of "
                              "the batch it handed out last, which is put back)")
        history = with_change(self.history or [(0, self.base.world_size)], step, n)
        if history == self.history and rank == self.rank and self.planner is not None and not self._joining:
            return
        self._stop()
        self.history, self.rank = history, rank
        # the live participants' own cursors: only the departed are replayed
        known = {int(c["rank"]): list(c["workers"]) for c in cursors or () if int(c["step"]) == step
                 and c["rank"] is not None}
        self._apply(step, known)

    def _rank_of(self, participants: Any, n: int, rank: int | None) -> int:
        if rank is None:
            if isinstance(participants, int):
                rank = self.base.rank
            else:
                ids = sorted(set(participants))
                if self.base.rank not in ids:
                    raise ConfigError(f"set_membership: this participant ({self.base.rank}) is not among the live "
                                      f"participants {ids}")
                rank = ids.index(self.base.rank)
        if not 0 <= int(rank) < n:
            raise ConfigError(f"set_membership: rank {rank} is not in 0..{n - 1} ({n} live participants)")
        return int(rank)

    def _apply(self, step: int, known: dict | None = None) -> None:
        """The loader set to this participant's position at ``step`` of the segment holding it."""
        loader, clock = self.loader, self.loader.clock
        if clock.plan is not None and loader.pass_over():  # (a restored clock has no plan yet)
            loader._end_pass()
        if self.planner is None or self.planner.pass_idx != clock.pass_idx:
            rest = clock.rest
            if rest is not None and not rest.elastic:
                raise ConfigError("set_membership: the pass was resumed statistically; a membership re-plans "
                                  "exactly and needs the pass's exact work (start it at the next pass)")
            self.planner = MembershipPlanner(self.base, workers_per_rank=loader.num_logical,
                                             batch_sizes=loader.batch_sizes, pass_idx=clock.pass_idx,
                                             first_step=clock.first_step, rest=rest)
        if known:
            self.planner.known[step] = known
        end = self.planner.segments(self.history, step)[-1].end
        if step >= end > self.planner.first_step:  # the pass ended before ``step``: the next one from its end
            clock.start(self.planner.pass_idx + 1, end)
            self.planner = None
            return self._apply(step)
        tally = loader.counters.tally
        seg, states, tokens = self.planner.position(self.history, step, self.rank,
                                                    lambda rows: tally(rows).num_tokens)
        loader.dataset = loader.checkpointer.dataset = member_dataset(self.base, self.rank, seg.n)
        clock.start(self.planner.pass_idx, seg.first_step, seg.rest)
        clock.plan = seg.plan
        clock.batch = step - seg.first_step
        clock.worker_states = states
        clock.pass_tokens = tokens
        self._before = None
        self._joining = False
        if loader.ledger is not None:  # the history in its chunks; the segment's plan with the next step
            loader.ledger.history = [list(e) for e in self.history]
            loader.ledger.replan(self.planner.pass_idx)

    def _next_pass(self) -> None:
        """At a new pass: its plan over the participants live at its first step."""
        clock = self.loader.clock
        if self.history is None or self.planner is None or self.planner.pass_idx == clock.pass_idx:
            return
        self.planner = None
        self._apply(clock.step)

    # -- in flight -------------------------------------------------------------------------
    def iterate(self, loader: Any) -> Iterator:
        """The loader's batches, restarted on the new plan at a membership change (``loader``:
        the loader itself, held while it iterates)."""
        if self._joining:
            raise ConfigError("this participant is not live at the restored step: call set_membership(step, "
                              "participants) with it among them before iterating")
        self._next_pass()
        self._inner = loader._iterate()
        serving = None  # the pass this iteration hands out: a change at its end ends the iteration
        try:
            while True:
                if self._inner is None:  # stopped by a change: continue on the new plan
                    if serving is not None and (loader.clock.pass_idx != serving or loader.pass_over()):
                        return
                    self._next_pass()
                    self._inner = loader._iterate()
                before = self._snapshot()
                try:
                    batch = next(self._inner)
                    serving = loader.clock.pass_idx
                    self._before = before
                except StopIteration:
                    return
                except BaseException:  # an interrupt (a signal) after the inner loop committed the batch
                    if loader.clock.step != before[0]:  # but before this loop handed it out: put it back
                        self._before = before
                        self._put_back()
                    raise
                yield batch  # nothing between the commit's guard and the yield runs a signal handler
        finally:
            self._stop()

    def _stop(self) -> None:
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()

    def _snapshot(self) -> tuple:
        loader, clock = self.loader, self.loader.clock
        return (clock.step, clock.pass_idx, clock.first_step, clock.batch, clock.pass_tokens,
                list(clock.worker_states), clock.rest, clock.plan, loader.counters.totals, loader.dataset)

    def _put_back(self) -> None:
        """Undo the hand-out of the last batch: not delivered, not counted, not in the ledger."""
        loader, clock = self.loader, self.loader.clock
        self._stop()
        (_, pass_idx, first_step, batch, pass_tokens, workers, rest, plan, totals, dataset) = self._before
        clock.start(pass_idx, first_step, rest)
        clock.batch, clock.pass_tokens, clock.worker_states, clock.plan = batch, pass_tokens, workers, plan
        loader.counters.totals = totals
        loader.dataset = loader.checkpointer.dataset = dataset
        self._before = None
        ledger = loader.ledger
        if ledger is not None:
            steps = getattr(ledger, "_steps", None)
            if steps and steps[-1][0] == clock.step:
                steps.pop()
                ledger._pieces.pop()
            elif steps is not None:  # already on storage: a generation from that step voids it
                ledger.start_generation(clock.step, "membership", scope="participant")  # its own steps only

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The job's state: the same on every participant."""
        loader, clock = self.loader, self.loader.clock
        if loader.ledger is not None:
            loader.ledger.flush()
        step, planner = clock.step, self.planner
        pass_idx, first, rest = ((planner.pass_idx, planner.first_step, planner.rest) if planner is not None
                                 else (clock.pass_idx, clock.first_step, clock.rest))  # (restored, not live yet)
        return {
            "kind": KIND, "version": VERSION, "fingerprint": loader.fingerprint, "step": step,
            "history": [[s, n] for s, n in self.history],
            "pass": pass_idx, "pass_first_step": first,
            "remaining": None if rest is None else rest.to_state(),
            "generation": self.base.resume_generation, "skip_steps": loader.skip_steps.to_list(),
        }

    def load_state_dict(self, state: dict[str, Any], rank: int | None = None) -> None:
        """Continue exactly at the saved step (this participant's rank: ``rank``, else the
        position it had, else the dataset's)."""
        loader = self.loader
        if state.get("version") != VERSION:
            raise ResumeMismatchError(f"membership state version {state.get('version')!r}, expected {VERSION}")
        if state.get("fingerprint") != loader.fingerprint:
            raise ResumeMismatchError("membership state: the job differs (corpus, seed, packing, workers or batch "
                                      f"size): fingerprint {state.get('fingerprint')} != {loader.fingerprint}")
        history = check_history(tuple(e) for e in state["history"])
        step = int(state["step"])
        self._stop()
        self.base.resume_generation = int(state["generation"])
        loader.clock.start(int(state["pass"]), int(state["pass_first_step"]), PassRest.from_state(state["remaining"]))
        self.planner = None
        self.history = history
        n = live_at(history, step)
        rank = self.rank if rank is None else rank
        if rank is None or not 0 <= rank < n:  # not live at the saved step: joins by set_membership
            self.rank, self._joining = None, True
            loader.clock.batch = step - loader.clock.first_step
            return
        self.rank = self._rank_of(n, n, rank)
        self._apply(step)
        from ..resume.state import ResumeReport
        loader.resume_report = ResumeReport(
            "exact", f"step {step} (pass {loader.clock.pass_idx}): rebuilt from the membership history "
            f"{self.history} as participant {self.rank} of {n}; the next batches are those of the uninterrupted run")
