"""torchft: replica groups that die and rejoin while the job runs, every token still once.

Under torchft each replica group is one data-parallel participant of the corpus, and the
groups live at a step are the quorum's. ``FaultTolerantData`` wires a torchft ``Manager`` to
a ``StreamingLoader``:

* before each step it runs the quorum (``manager.start_quorum()``), then tells the loader who
  is live from the manager's step on (``set_membership(step, num_participants, rank=
  participating_rank)``): when the quorum changed, the rest of the pass is re-planned there
  over the live groups (``loader/membership.py``): a departed group's unconsumed work goes
  to the survivors, a rejoining one takes a share of what is left, on one step clock;
* a step that was not committed (``should_commit()`` False, the manager's step unchanged)
  puts its batch back: the step is rebuilt, on the new membership if it changed;
* with a ledger, each group records under its own participant id: its restart voids its own
  later steps only, and the steps past its last commit are void (docs/ledger.md), except a
  step another group of its quorum committed: a group killed after its gradients were reduced
  and before its commit was trained at that step (its step's pieces are written before the
  batch is handed to the trainer; ``read_ledger`` counts them where the membership history
  has more groups live at the step than committed it);
* it registers the loader's state with the manager (``register_state_dict_fn``): a group
  that heals receives it with the weights. That state is the membership history and the step,
  small and the same on every group, not a peer's cursors: the healed group computes its own.

Usage (a plain optimizer; ``OptimizerWrapper`` would run a second quorum in ``zero_grad``)::

    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None, min_replica_size=1,
                      use_async_quorum=False, ...)
    dataset = PackedTokenDataset(streams, seq_len=2048, rank=replica_group, world_size=max_groups)
    data = FaultTolerantData(StreamingLoader(dataset, batch_size=8), manager)
    for batch in data:                 # the quorum, the membership, then the batch of this step
        loss = model(**batch).loss
        loss.backward()
        for p in model.parameters():   # or torchft's DistributedDataParallel
            manager.allreduce(p.grad).wait()
        if data.should_commit():       # manager.should_commit(), the commit kept in the ledger
            optimizer.step()
        optimizer.zero_grad()

``use_async_quorum=False`` is required: with an asynchronous quorum a healing group trains a
step before it is a participant, and the data it was dealt would be lost.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

from ..errors import ConfigError
from ..loader.loader import StreamingLoader

KEY = "streamforge"


class FaultTolerantData:
    """A ``StreamingLoader`` fed by a torchft ``Manager``'s quorums (see the module docstring).

    Args:
        loader: the group's loader; its dataset's ``rank`` is the replica group's index times the
            group's ranks plus the rank in the group, its ``world_size`` the most groups times the
            group's ranks (with one rank a group: the group's index, the most groups); every group
            builds the same dataset. Ranks of a group that must get the same batches (tensor
            parallel) are not supported here: give each group one data-parallel rank per process.
        manager: the group's ``torchft.Manager`` (``use_async_quorum=False``).
        register: register the loader's state with ``manager`` for healing (default True).
    """

    def __init__(self, loader: StreamingLoader, manager: Any, *, register: bool = True) -> None:
        if not isinstance(loader, StreamingLoader):
            raise TypeError(f"FaultTolerantData takes a StreamingLoader, got {type(loader).__name__}")
        if getattr(manager, "_use_async_quorum", False):
            raise ConfigError("FaultTolerantData needs Manager(use_async_quorum=False): with an asynchronous "
                              "quorum a healing group trains before it participates, and its data is lost")
        self.loader = loader
        self.manager = manager
        self._healed: dict | None = None
        if loader.ledger is not None:  # a group restarts on its own, and only committed steps count
            loader.ledger.participant = loader.ledger.commits = True
        if register:
            manager.register_state_dict_fn(KEY, self.load_state_dict, self.state_dict)

    # -- the state torchft sends to a healing group -----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The loader's state: the membership history and the step (the same on every group)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Called by the manager while healing: applied at the next ``sync`` (at the healed step)."""
        self._healed = copy.deepcopy(state)

    # -- each step ------------------------------------------------------------------------
    def sync(self) -> None:
        """After the quorum: the loader at the manager's step, on the live groups."""
        manager, loader = self.manager, self.loader
        step = int(manager.current_step())
        rank = manager.participating_rank()
        n = int(manager.num_participants())
        if rank is None:
            raise ConfigError(f"replica group is not a participant of the quorum at step {step}: "
                              "FaultTolerantData deals data to participants only")
        # a group of several data-parallel ranks (FSDP inside the group): each is a participant
        per_group = int(getattr(manager, "_group_world_size", 1) or 1)
        n, rank = n * per_group, int(rank) * per_group + int(getattr(manager, "_group_rank", 0) or 0)
        if self._healed is not None:  # from the step and the history alone
            state, self._healed = self._healed, None
            if state.get("kind") is not None:  # (none: the sender's first quorum, no history yet)
                state["step"] = step
                loader.load_state_dict(state)
        if loader.ledger is not None and step > 0:  # the manager's step moves on a commit only
            loader.ledger.commit(step - 1)
        loader.set_membership(step, n, rank=int(rank))

    def should_commit(self) -> bool:
        """``manager.should_commit()``, with the step's commit written to the ledger before it
        returns (else at the next step's ``sync``: a group killed in between leaves a step
        trained but not in the ledger)."""
        ok = bool(self.manager.should_commit())
        if ok and self.loader.ledger is not None:
            self.loader.ledger.commit(int(self.manager.current_step()) - 1, wait=True)
        return ok

    def __iter__(self) -> Iterator[dict]:
        it = None
        try:
            while True:
                self.manager.start_quorum()
                self.sync()
                if it is None:
                    it = iter(self.loader)
                try:
                    batch = next(it)
                except StopIteration:
                    return
                if self.loader.ledger is not None:  # the step's pieces on storage before it is trained
                    self.loader.ledger.flush(wait=True)
                yield batch
        finally:
            if it is not None:
                it.close()
