"""Who this process is in the data-parallel group, who its replicas are, and the loader's collectives.

``Topology`` answers two questions:

* "which data-parallel rank am I, of how many": the plan splits the corpus over
  ``world_size`` ranks and this process reads rank ``rank``'s share;
* "who are my replicas": in a hybrid-parallel job (tensor, context or pipeline parallel) the
  ranks of one model-parallel group share a data-parallel rank and must get the same batches.
  ``replica`` is this process's index among them, ``replicas`` their number.

It is built from explicit values (``rank=``, ``world_size=``), from a ``DeviceMesh`` and the
names of its data-parallel dimensions (``from_mesh``), from a Megatron-style data-parallel
``ProcessGroup`` (``from_group``), or from torch.distributed and the environment
(``resolve``). Every collective the loader runs is a method here, so that each runs on the
right group and is written once:

* ``gather``: the ranks' state parts, over the data-parallel group (replicas hold the same);
* ``agree_min``/``agree_max``: a count agreed on by every process of the job;
* ``from_rank_zero``: the manifests, read once and broadcast to every process;
* ``broadcast_to_replicas``: a batch built by replica 0 handed to the others (``read_once``).

The process groups are local to the process that made them: a topology sent to a DataLoader
worker arrives with its ranks and without its groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .errors import ConfigError

NOT_DATA = ("cp", "tp", "pp", "ep")  # mesh dimensions whose ranks share a batch
DATA_DIMS = ("dp", "dp_replicate", "dp_shard")


def _dist():
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def _group_size() -> int:
    """The process group's size; 1 without one."""
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


@dataclass(frozen=True)
class Groups:
    """The process groups of a hybrid-parallel topology (this process's only).

    Args:
        data: the data-parallel group (None: the default group is it).
        data_ranks: its members' global ranks, by data-parallel rank.
        replica: the group of this process's replicas (None: it has none).
        replica_ranks: their global ranks, by replica index.
    """

    data: Any
    data_ranks: tuple[int, ...]
    replica: Any
    replica_ranks: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    """This process's place in the data-parallel group and among its replicas.

    Args:
        rank: the data-parallel rank, ``0 <= rank < world_size``.
        world_size: the number of data-parallel ranks the corpus is split over.
        replica: this process's index among the processes that share its data-parallel rank
            (tensor, context or pipeline parallel peers), ``0 <= replica < replicas``.
        replicas: how many processes share each data-parallel rank.
        groups: the process groups behind a mesh or a data-parallel group (``Groups``); not
            compared, not pickled.
        source: where the ranks came from: ``"explicit"`` (``rank=``/``world_size=``),
            ``"torch.distributed"``, ``"environment"`` (``RANK``/``WORLD_SIZE``),
            ``"default"`` (none of those: 0 of 1), ``"pending"`` (only one of ``RANK`` and
            ``WORLD_SIZE`` was set: resolved when first used, see ``checked``), ``"mesh"``,
            ``"group"``, ``"membership"`` (a live participant's position among the live ones,
            ``loader/membership.py``: not checked against a process group). Not compared.
    """

    rank: int
    world_size: int
    replica: int = 0
    replicas: int = 1
    groups: Groups | None = field(default=None, compare=False, repr=False)
    source: str = field(default="explicit", compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is not in 0..world_size-1 (world_size {self.world_size})")
        if self.replicas < 1 or not 0 <= self.replica < self.replicas:
            raise ConfigError(f"replica {self.replica} is not in 0..replicas-1 (replicas {self.replicas})")

    def __reduce__(self):  # to a worker process: the ranks, not the groups
        return (Topology, (self.rank, self.world_size, self.replica, self.replicas, None, self.source))

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def build(cls, rank: int | None = None, world_size: int | None = None, *, mesh: Any = None,
              dp_dims: Sequence[str] | str | None = None, group: Any = None) -> Topology:
        """The topology the dataset's arguments describe (``PackedTokenDataset`` says how)."""
        if mesh is not None:
            given = [n for n, v in (("rank", rank), ("world_size", world_size), ("group", group)) if v is not None]
            if given:
                raise ConfigError(f"mesh= gives the data-parallel rank and size: do not pass {', '.join(given)} too")
            return cls.from_mesh(mesh, dp_dims)
        if dp_dims is not None:
            raise ConfigError("dp_dims= names dimensions of a mesh: pass mesh= too")
        if group is not None:
            return cls.from_group(group, rank, world_size)
        return cls.resolve(rank, world_size)

    @classmethod
    def resolve(cls, rank: int | None = None, world_size: int | None = None) -> Topology:
        """Explicit values, else torch.distributed's, else ``RANK``/``WORLD_SIZE``, else 0 of 1.
        Only one of ``RANK`` and ``WORLD_SIZE`` set (a launcher part-way through setting up a
        process, as Lightning's is when a DataModule is built) leaves the topology
        ``"pending"``: 0 of 1 until ``checked`` resolves it."""
        if rank is not None and world_size is not None:
            return cls(int(rank), int(world_size))
        dist = _dist()
        if dist is not None:
            source = "torch.distributed" if rank is None and world_size is None else "explicit"
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
            return cls(int(rank), int(world_size), source=source)
        env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        if (env_rank is None) != (env_world is None) and (rank is None or world_size is None):
            return cls(0, 1, source="pending")
        source = "environment" if env_rank is not None else "default"
        rank = int(env_rank or 0) if rank is None else rank
        world_size = int(env_world or 1) if world_size is None else world_size
        return cls(int(rank), int(world_size), source=source)

    def checked(self) -> Topology:
        """This topology, checked against torch.distributed now (the loader calls it when
        iteration starts, and at save and resume time): one resolved before the process
        group existed (from defaults or a part-set environment) is resolved again, as the
        group says; one that disagrees with the group raises ``ConfigError`` naming both
        values and where each came from. Without a process group (a DataLoader worker, say), a
        topology from defaults or a part-set environment is resolved from the environment
        where it is now set, and ``RANK`` without ``WORLD_SIZE`` (or the reverse) is a
        ``ConfigError``."""
        if self.source in ("mesh", "group", "membership"):
            return self
        dist = _dist()
        if dist is None:  # a DataLoader worker, or a job without a group: the environment decides
            env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
            if self.source not in ("pending", "default") or (
                    self.source == "default" and env_rank is None and env_world is None):
                return self
            if (env_rank is None) != (env_world is None):
                raise ConfigError(
                    f"the environment sets {'RANK' if env_rank is not None else 'WORLD_SIZE'} but not "
                    f"{'WORLD_SIZE' if env_rank is not None else 'RANK'}, and torch.distributed is not "
                    "initialized: set both, initialize the process group first, or pass rank= and world_size=")
            return Topology.resolve()
        rank, world = dist.get_rank(), dist.get_world_size()
        if (rank, world) == (self.rank, self.world_size) and self.source != "pending":
            return self
        if self.source in ("default", "environment", "pending"):
            return Topology(rank, world, source="torch.distributed")
        said = f"rank {self.rank} of {self.world_size} ({self.source})"
        if self.source == "explicit" and world != self.world_size:
            raise ConfigError(
                f"{said} disagrees with torch.distributed's rank {rank} of {world}: in a job where not every "
                "process is a data-parallel rank (tensor, context or pipeline parallel), pass mesh= or the "
                "data-parallel group= (docs/parallelism.md), so that the state is gathered over the right ranks")
        raise ConfigError(f"{said} disagrees with torch.distributed's rank {rank} of {world}")

    @classmethod
    def from_group(cls, group: Any, rank: int | None = None, world_size: int | None = None) -> Topology:
        """Megatron-style: ``group`` is the data-parallel ``ProcessGroup`` (e.g.
        ``mpu.get_data_parallel_group()``); ``rank``/``world_size``, where given, must be this
        process's rank in it and its size. Every process of the job must call this (the
        replica groups are made here)."""
        dist = _dist()
        if dist is None:
            raise ConfigError("group= needs torch.distributed initialized (init_process_group) first")
        try:
            ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
        except Exception as exc:  # noqa: BLE001 - named below
            raise ConfigError(f"group= is not a torch.distributed ProcessGroup ({type(group).__name__}): {exc}") from exc
        me = dist.get_rank()
        problem = None  # raised on every process, not just here: the others would wait in a collective
        if me not in ranks:
            problem = f"group=: process {me} is not a member of the data-parallel group {list(ranks)}"
        elif world_size is not None and int(world_size) != len(ranks):
            problem = f"world_size={world_size} disagrees with group= of {len(ranks)} ranks {list(ranks)}"
        elif rank is not None and int(rank) != ranks.index(me):
            problem = (f"rank={rank} disagrees with group=: process {me} is data-parallel rank "
                       f"{ranks.index(me)} of its group {list(ranks)}")
        return cls._with_groups(ranks, group if len(ranks) < dist.get_world_size() else None, problem, "group")

    @classmethod
    def from_mesh(cls, mesh: Any, dp_dims: Sequence[str] | str | None = None) -> Topology:
        """The data-parallel rank is this process's flattened coordinate over ``dp_dims`` of
        ``mesh`` (default: ``mesh_data_dims``); every other dimension holds replicas. Every
        process of the job must call this (the groups are made here)."""
        dist = _dist()
        if dist is None:
            raise ConfigError("mesh= needs torch.distributed initialized (init_device_mesh does it)")
        names = mesh_data_dims(mesh, dp_dims)
        sub = mesh[names[0] if len(names) == 1 else tuple(names)]
        ranks = tuple(int(r) for r in sub.mesh.flatten().tolist())
        problem = None if dist.get_rank() in ranks else \
            f"mesh=: process {dist.get_rank()} is not in its data-parallel ranks {list(ranks)}"
        return cls._with_groups(ranks, None, problem, "mesh")

    @classmethod
    def _with_groups(cls, data_ranks: tuple[int, ...], data_group: Any, problem: str | None,
                     source: str) -> Topology:
        """The topology of this process, whose data-parallel group is ``data_ranks``: the
        groups are learned from every process's (one all-gather) and made (collectively). A
        ``problem`` found by any process is raised on all of them."""
        dist = _dist()
        me = dist.get_rank()
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (data_ranks, problem))
        problems = [f"process {p}: {why}" for p, (_, why) in enumerate(every) if why]
        if problems:
            raise ConfigError("; ".join(problems))
        data_lists = sorted({tuple(g) for g, _ in every})
        members = sorted(r for g in data_lists for r in g)
        if members != list(range(dist.get_world_size())) or len({len(g) for g in data_lists}) != 1:
            raise ConfigError(
                "the data-parallel groups of the job's processes do not partition it into groups of one "
                f"size: {[list(g) for g in data_lists]}")
        size = len(data_ranks)
        replica_lists = [tuple(g[k] for g in data_lists) for k in range(size)]
        if size > 1 and len(data_lists) > 1 and data_group is None:
            data_group = _subgroup(data_lists, data_ranks)
        elif len(data_lists) == 1:
            data_group = None  # the default group is the data-parallel group
        rank = data_ranks.index(me)
        mine = replica_lists[rank]
        replica_group = _subgroup(replica_lists, mine) if len(mine) > 1 else None
        groups = Groups(data_group, tuple(data_ranks), replica_group, tuple(mine))
        return cls(rank, size, mine.index(me), len(mine), groups, source)

    # -- collectives (each a no-op without a process group) ------------------------------------
    def gather(self, part: Any) -> list[Any]:
        """Every data-parallel rank's ``part`` (one all-gather over the data-parallel group;
        replicas get the same list) where the process group holds this topology; else a list
        holding this rank's part alone (the others None)."""
        parts: list[Any] = [None] * self.world_size
        if self.world_size > 1 and self.groups is not None:
            torch.distributed.all_gather_object(parts, part, group=self.groups.data)
            return parts
        if self.world_size > 1 and self.replicas == 1 and _group_size() == self.world_size:
            torch.distributed.all_gather_object(parts, part)
            return parts
        parts[self.rank] = part
        return parts

    @property
    def can_gather(self) -> bool:
        """Does ``gather`` reach every data-parallel rank here, the ranks read from the process
        group or its launcher (not given by hand, where a rank may disagree with the group and
        never join)? False in a DataLoader worker or a job without a group."""
        if self.world_size <= 1 or self.source not in ("torch.distributed", "environment", "mesh", "group"):
            return False
        return self.groups is not None or (self.replicas == 1 and _group_size() == self.world_size)

    def agree_min(self, value: int, device: torch.device | str = "cpu") -> int:
        """The minimum of ``value`` over the job's processes (one all-reduce); ``value`` without a group."""
        return _all_reduce_int(value, "MIN", device)

    def agree_max(self, value: int, device: torch.device | str = "cpu") -> int:
        """The maximum of ``value`` over the job's processes (one all-reduce); ``value`` without a group."""
        return _all_reduce_int(value, "MAX", device)

    def broadcast_to_replicas(self, obj: Any) -> Any:
        """``obj`` as replica 0 has it (one broadcast over the replica group): replica 0 passes
        what it built, the others anything (None) and get replica 0's."""
        if self.groups is None or self.groups.replica is None:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=self.groups.replica_ranks[0], group=self.groups.replica)
        return box[0]

    def gather_replicas(self, value: Any) -> list[Any]:
        """Every replica's ``value`` (one all-gather over the replica group); ``[value]`` without replicas."""
        if self.groups is None or self.groups.replica is None:
            return [value]
        out: list[Any] = [None] * self.replicas
        torch.distributed.all_gather_object(out, value, group=self.groups.replica)
        return out

    @staticmethod
    def from_rank_zero(load: Callable[[], Any]) -> Any:
        """``load()`` run on rank 0 alone and its result broadcast to every rank; an
        exception there is raised on every rank. Without a process group, ``load()``."""
        dist = _dist()
        if dist is None or dist.get_world_size() == 1:
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


def mesh_data_dims(mesh: Any, dp_dims: Sequence[str] | str | None = None) -> list[str]:
    """The names of ``mesh``'s data-parallel dimensions: ``dp_dims``, checked; by default the
    flattened ``batch`` dimension where the mesh has one, else whichever of ``dp``,
    ``dp_replicate`` and ``dp_shard`` it has. Never ``cp``, ``tp``, ``pp`` or ``ep``, nor a
    flattened dimension that spans one of them (``ConfigError`` naming it)."""
    own = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not own:
        raise ConfigError("mesh= needs named dimensions (init_device_mesh(..., mesh_dim_names=(...)))")
    flat = _flattened_names(mesh)
    known = list(own) + [n for n in flat if n not in own]
    if dp_dims is None:
        if "batch" in known:
            names = ["batch"]
        elif "dp" in known:
            names = ["dp"]
        else:
            names = [n for n in DATA_DIMS[1:] if n in known]
        if not names:
            raise ConfigError(f"mesh dimensions {known} have no data-parallel one (batch, {', '.join(DATA_DIMS)}): "
                              "name them with dp_dims=")
    else:
        names = [dp_dims] if isinstance(dp_dims, str) else [str(n) for n in dp_dims]
        missing = [n for n in names if n not in known]
        if missing or not names:
            raise ConfigError(f"dp_dims {names}: {missing or 'no dimension'} not in the mesh's dimensions {known}")
        if len(set(names)) != len(names):
            raise ConfigError(f"dp_dims {names} names a dimension twice")
    for name in names:
        spans = [d for d in NOT_DATA if d in own and d != name and _spans(mesh, name, d)]
        if name in NOT_DATA or spans:
            raise ConfigError(
                f"mesh dimension {name!r} is not data-parallel"
                + (f": it spans {spans}, whose ranks share a batch" if spans else ": its ranks share a batch")
                + "; name the data-parallel dimensions with dp_dims=")
    return names


def _flattened_names(mesh: Any) -> list[str]:
    """Names of the dimensions flattened from ``mesh``'s root (torchtitan's ``batch``...)."""
    try:
        root = mesh._get_root_mesh()  # noqa: SLF001 - the only way to list flattened dimensions
        return list(getattr(root, "_flatten_mapping", {}) or {})
    except Exception:  # noqa: BLE001 - a mesh without flattening
        return []


def _spans(mesh: Any, name: str, other: str) -> bool:
    """Does dimension ``name`` (a flattened one, say) include ``other``'s ranks of this process?"""
    try:
        mine = set(mesh[name].mesh.flatten().tolist())
        theirs = mesh[other].mesh.flatten().tolist()
    except Exception:  # noqa: BLE001 - not a dimension here
        return False
    return len(theirs) > 1 and set(theirs) <= mine


def _subgroup(lists: Sequence[tuple[int, ...]], mine: tuple[int, ...]) -> Any:
    """The group of ``mine`` among ``lists`` (made by every process, in one order, on gloo:
    the loader's collectives carry host objects)."""
    dist = torch.distributed
    backend = "gloo" if dist.is_gloo_available() else None
    group = None
    for ranks in lists:
        made = dist.new_group(list(ranks), backend=backend)
        if tuple(ranks) == tuple(mine):
            group = made
    return group


def _all_reduce_int(value: int, op: str, device: torch.device | str) -> int:
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return value
    if dist.get_backend() == "nccl":
        device = device if torch.device(device).type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return int(t.item())
