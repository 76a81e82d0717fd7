"""Who this process is in the data-parallel group, and the loader's few collectives.

``Topology`` answers "which data-parallel rank am I, of how many": the plan splits the corpus
over ``world_size`` ranks and this process reads rank ``rank``'s share. Every collective the
loader runs (gathering the ranks' states at checkpoint time, agreeing on a count at resume
time, sharing the manifests read by rank 0) is a method here, so that they all run on the
same group and are written once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import ConfigError


def _group_size() -> int:
    """The process group's size; 1 without one."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass(frozen=True)
class Topology:
    """This process's place in the data-parallel group.

    Args:
        rank: the data-parallel rank, ``0 <= rank < world_size``.
        world_size: the number of data-parallel ranks the corpus is split over.
    """

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not in 0..world_size-1 (world_size {self.world_size})")

    @classmethod
    def resolve(cls, rank: int | None = None, world_size: int | None = None) -> Topology:
        """Explicit values, else torch.distributed's, else ``RANK``/``WORLD_SIZE``, else 0 of 1."""
        if rank is None or world_size is None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank() if rank is None else rank
                world_size = dist.get_world_size() if world_size is None else world_size
            else:
                rank = int(os.environ.get("RANK", 0)) if rank is None else rank
                world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        return cls(int(rank), int(world_size))

    # -- collectives (each a no-op without a process group of this size) ---------------------
    def gather(self, part: Any) -> list[Any]:
        """Every rank's ``part`` (one all-gather) where the process group is this topology;
        else a list holding this rank's part alone (the others None)."""
        if self.world_size > 1 and _group_size() == self.world_size:
            parts: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(parts, part)
            return parts
        parts = [None] * self.world_size
        parts[self.rank] = part
        return parts

    def agree_min(self, value: int, device: torch.device | str = "cpu") -> int:
        """The minimum of ``value`` over the process group (one all-reduce); ``value`` without one."""
        return _all_reduce_int(value, "MIN", device)

    def agree_max(self, value: int, device: torch.device | str = "cpu") -> int:
        """The maximum of ``value`` over the process group (one all-reduce); ``value`` without one."""
        return _all_reduce_int(value, "MAX", device)

    @staticmethod
    def from_rank_zero(load: Callable[[], Any]) -> Any:
        """``load()`` run on rank 0 alone and its result broadcast to every rank; an
        exception there is raised on every rank. Without a process group, ``load()``."""
        dist = torch.distributed
        if _group_size() == 1:
            return load()
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = load()
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                box[0] = exc
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]


def _all_reduce_int(value: int, op: str, device: torch.device | str) -> int:
    dist = torch.distributed
    if _group_size() == 1:
        return value
    if dist.get_backend() == "nccl":
        device = device if torch.device(device).type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return int(t.item())
