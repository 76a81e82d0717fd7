"""torchtitan (0.3): its trainer fed from streamforge shards, its checkpoints holding the data order.

torchtitan builds the data loader from the trainer's config: ``Trainer.Config.dataloader`` is
a ``BaseDataLoader.Config``, whose ``build(...)`` the trainer calls once in every process with
``dp_world_size``, ``dp_rank``, ``tokenizer``, ``seq_len``, ``local_batch_size`` and
``snapshot_every_n_steps``. It iterates the loader for ``({"input": [B, L], "positions": [B,
L]}, labels)`` and gives it to its ``CheckpointManager``, which saves and loads it with DCP
under the key ``dataloader``. ``StreamforgeDataLoader`` is such a loader; name its ``Config``
in a config-registry function (docs/integrations-torchtitan.md):

    config = llama3_debugmodel()
    config.dataloader = StreamforgeDataLoader.Config(streams=["s3://corpus/web", "s3://corpus/code"],
                                                     weights=[0.7, 0.3], num_workers=2)

What it does with each part of torchtitan's contract:

* **Batches.** ``input_ids`` is handed out as ``input``, ``position_ids`` as ``positions``
  (0 at the start of every document piece: torchtitan's flex and varlen attention build their
  block-causal masks from where positions restart, and RoPE reads them), ``labels`` as they
  are (already shifted; -100, the loss's ignore index, across document ends and on padding).
  The other fields are never computed. Batches stay on the CPU: torchtitan's trainer counts
  the valid labels on the CPU and moves each micro-batch to its device itself.
* **Who reads what.** The plan splits the corpus over the ``dp_world_size`` data-parallel
  ranks. Where the job has more processes than that (tensor, context or pipeline parallel),
  the processes of one ``dp_rank`` are replicas and get the same batches, and the loader's
  state is gathered over a data-parallel group. torchtitan passes no process group, so the
  loader derives one from every process's ``dp_rank`` (``data_parallel_group``; one
  all-gather and one ``new_group`` per group, when the loader is built). A loader built by
  hand may pass ``group=`` or ``mesh=`` instead.
* **The checkpoint.** ``state_dict()`` is ``StreamingLoader.state_dict()``: the data order of
  the whole job, the same small dict on every process (a collective: DCP calls it on every
  process, at save and at load). DCP keeps one copy of it, under ``dataloader``; every
  process loads it whole. On the same data-parallel degree the resume is exact; on another,
  elastic (the rest of the pass re-planned over the new ranks, every token not yet delivered
  exactly once). ``snapshot_every_n_steps`` is not needed: the state is exact after every
  batch.
* **An endless stream of finite passes.** torchtitan trains for a number of steps, so the
  iterator goes from one pass to the next (each pass shuffled anew) until ``passes`` passes
  are done (0: never). Finite passes keep the elastic resume; ``infinite=True`` (each stream
  cycling on its own) resumes statistically on another data-parallel degree.

The trainer's tokenizer is not used: the shards hold token ids already. They must be below
the model's vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

try:
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.tools.logging import logger
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "streamforge.integrations.torchtitan needs torchtitan 0.3: install it in the same pip command as "
        "streamforge, pip install -c constraints.txt -e '.[torchtitan]' (docs/integrations-torchtitan.md)"
    ) from exc

from ..errors import ConfigError
from ..ledger.attach import LedgerConfig
from ..loader.loader import StreamingLoader
from ..pipeline.config import PackingConfig, ShuffleConfig
from ..pipeline.dataset import PackedTokenDataset, Stream

FIELDS = ("input_ids", "labels", "position_ids")  # what torchtitan's batches are made of


class StreamforgeDataLoader(BaseDataLoader):
    """A torchtitan data loader over streamforge streams, built by the trainer from its ``Config``.

    Args:
        config: the loader's settings (``StreamforgeDataLoader.Config``).
        dp_world_size: the number of data-parallel ranks (torchtitan's ``batch`` mesh size).
        dp_rank: this process's data-parallel rank.
        tokenizer: the trainer's tokenizer; not used (the shards are tokenized).
        seq_len: tokens per row.
        local_batch_size: rows per batch on this rank.
        snapshot_every_n_steps: torchdata's snapshot interval; not used.
        group: the data-parallel ``ProcessGroup`` (default: derived, see the module's text).
        mesh: a ``DeviceMesh`` whose data-parallel dimensions give the rank (instead of
            ``group``); its rank and size must be ``dp_rank`` and ``dp_world_size``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        streams: list[str] = field(default_factory=list)
        """Stream URLs (each a prefix holding index.json); empty: dataset_path, one stream."""

        weights: list[float] = field(default_factory=list)
        """Each stream's share of the tokens (empty: equal shares)."""

        names: list[str] = field(default_factory=list)
        """Stable stream names, which key the seeds and the state (empty: stream0, stream1...)."""

        seed: int = 0
        """Seed of the plan and the shuffles."""

        shuffle_buffer: int = ShuffleConfig.buffer
        """Documents in a full shuffle window, per stream."""

        shuffle_warmup: int = ShuffleConfig.warmup
        """Documents in a pass's first window, doubling up to shuffle_buffer."""

        packing: str = PackingConfig.mode
        """concat, bestfit or pad (docs/batch.md)."""

        eos_id: int | None = None
        """EOS appended to documents that lack one (default: the manifest's)."""

        passes: int = 0
        """Passes over the corpus before the loader ends (0: no end)."""

        infinite: bool = False
        """Each stream cycles on its own, without passes (a resume on another data-parallel
        degree is then statistical, not elastic)."""

        num_workers: int = 0
        """DataLoader worker processes per rank."""

        prefetch_factor: int = 2
        """Messages each worker process may have in flight."""

        pin_memory: bool = False
        """Pin the batches (they stay on the CPU)."""

        read_once: bool = False
        """Only the first replica of each data-parallel rank reads; it broadcasts the batches."""

        ledger: str = ""
        """URL of a data-order ledger (docs/ledger.md); empty: none."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any = None,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = None,
        group: Any = None,
        mesh: Any = None,
        **unused: Any,
    ) -> None:
        self.config = config
        self.dp_rank, self.dp_world_size = int(dp_rank), int(dp_world_size)
        dataset = self.make_dataset(config, seq_len=seq_len, **self._topology(group, mesh))
        topology = dataset.topology
        if (topology.rank, topology.world_size) != (self.dp_rank, self.dp_world_size):
            raise ConfigError(
                f"the dataset's data-parallel rank {topology.rank} of {topology.world_size} ({topology.source}) "
                f"disagrees with torchtitan's dp_rank {self.dp_rank} of dp_world_size {self.dp_world_size}")
        self.loader = StreamingLoader(
            dataset, batch_size=local_batch_size, num_workers=config.num_workers,
            prefetch_factor=config.prefetch_factor, pin_memory=config.pin_memory, device="cpu",
            fields=FIELDS, read_once=config.read_once,
            ledger=LedgerConfig(config.ledger) if config.ledger else None,
        )

    def _topology(self, group: Any, mesh: Any) -> dict[str, Any]:
        """The dataset's topology arguments: ``mesh=`` or ``group=`` as given, else a derived
        data-parallel group where the job has replicas, else the rank and size alone."""
        if mesh is not None and group is not None:
            raise ConfigError("pass group= or mesh=, not both")
        if mesh is not None:
            return {"mesh": mesh}
        if group is None and _world_size() > self.dp_world_size:
            group = data_parallel_group(self.dp_rank, self.dp_world_size)
        topology: dict[str, Any] = {"rank": self.dp_rank, "world_size": self.dp_world_size}
        return topology if group is None else {**topology, "group": group}

    def make_dataset(self, config: Config, *, seq_len: int, **topology: Any) -> PackedTokenDataset:
        """The ``PackedTokenDataset`` of ``config`` on ``topology`` (``rank``/``world_size``,
        ``group`` or ``mesh``). Override it to pass what a config cannot hold (a
        ``StorageConfig``, per-stream ``storage_options``)."""
        urls = list(config.streams) or ([config.dataset_path] if config.dataset_path else [])
        if not urls:
            raise ConfigError("StreamforgeDataLoader.Config names no stream: set streams= (or dataset_path=)")
        for what, values in (("weights", config.weights), ("names", config.names)):
            if values and len(values) != len(urls):
                raise ConfigError(f"StreamforgeDataLoader.Config has {len(urls)} stream(s) and {len(values)} {what}")
        weights = list(config.weights) or [1.0] * len(urls)
        names = list(config.names) or [None] * len(urls)
        streams = [Stream(url, weight=float(w), name=n) for url, w, n in zip(urls, weights, names)]
        return PackedTokenDataset(
            streams, seq_len=seq_len, seed=config.seed, infinite=config.infinite, eos_id=config.eos_id,
            shuffle=ShuffleConfig(buffer=config.shuffle_buffer, warmup=config.shuffle_warmup),
            packing=PackingConfig(config.packing), **topology,
        )

    # -- what the trainer calls ------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """``({"input", "positions"}, labels)`` batches, pass after pass, until ``passes``
        passes are done (never with ``passes=0``) or a pass has no full batch to give."""
        loader, passes = self.loader, self.config.passes
        while not passes or loader.infinite or loader.clock.pass_idx < passes:
            delivered = False
            for batch in loader:
                delivered = True
                yield {"input": batch["input_ids"], "positions": batch["position_ids"]}, batch["labels"]
            if not delivered:  # an empty pass (the loader warned): the next would be empty too
                return

    def state_dict(self) -> dict[str, Any]:
        """The job's data order (``StreamingLoader.state_dict``): the same on every process.
        Every process must call it: the data-parallel ranks' parts are gathered here."""
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` (nothing to do for an empty one); exact on the same
        data-parallel degree, elastic on another (``resume_report`` says which)."""
        if not state_dict:
            return
        self.loader.load_state_dict(state_dict)
        logger.info(f"streamforge: {self.loader.resume_report}")

    @property
    def resume_report(self) -> Any:
        """How the last ``load_state_dict`` resumed (``ResumeReport``), or None."""
        return self.loader.resume_report

    @property
    def step(self) -> int:
        """The global step of the next batch (``StreamingLoader.step``): batches, not
        torchtitan's optimizer steps, which may take several (gradient accumulation)."""
        return self.loader.step


def data_parallel_group(dp_rank: int, dp_world_size: int) -> Any:
    """This process's data-parallel ``ProcessGroup`` in a job of more processes than
    ``dp_world_size``, from every process's ``dp_rank`` (one all-gather; every process of the
    job must call this, in the same order as its other ``new_group`` calls).

    The processes sharing a data-parallel rank are replicas, numbered by global rank; group
    ``k`` is replica ``k`` of every data-parallel rank, in data-parallel order. On torchtitan's
    mesh (``pp, dp_replicate, dp_shard, cp, tp``, the last fastest) these are the ``batch``
    groups. The groups are made on gloo, which carries the loader's host objects in a NCCL job
    too. A bad assignment (a rank out of range, unequal replica counts, different sizes) is a
    ``ConfigError`` raised on every process."""
    dist = torch.distributed
    world, me = dist.get_world_size(), dist.get_rank()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (int(dp_rank), int(dp_world_size)))
    sizes = sorted({size for _, size in every})
    holders = {r: [p for p, (rank, _) in enumerate(every) if rank == r] for r in range(dp_world_size)}
    if sizes != [dp_world_size] or sum(map(len, holders.values())) != world or \
            len({len(h) for h in holders.values()}) != 1:
        raise ConfigError(
            "the processes' data-parallel ranks do not split the job into equal replica groups: "
            f"(dp_rank, dp_world_size) by process: {every}")
    backend = "gloo" if dist.is_gloo_available() else None
    mine = None
    for k in range(world // dp_world_size):
        ranks = [holders[r][k] for r in range(dp_world_size)]
        made = dist.new_group(ranks, backend=backend)
        if me in ranks:
            mine = made
    return mine


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
