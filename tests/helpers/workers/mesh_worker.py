"""A hybrid-parallel job under torchrun (gloo, CPU): the loader on a DeviceMesh of
("dp", "tp"), or on a Megatron-style data-parallel group, saved and loaded through DCP.

    mesh_worker.py OUT MODE DP TP URL...

MODE:
* ``run``: mesh (DP, TP); the whole pass, a DCP save after step SAVE_AT (OUT/ckpt), an
  all-reduce over the data-parallel group after every step (as DDP would do);
* ``resume``: mesh (DP, TP); load OUT/ckpt through DCP and train to the end of the pass;
* ``variants``: mesh (DP, TP) with ``read_once=True``, replica 1 a pipeline stage that asks
  for the labels only, for STEPS steps; then the same steps Megatron-style (``group=`` made
  with ``new_group``); then every bad configuration, each error recorded.

Every process appends ``{"step", "dp", "replica", "pieces", "input_ids", "labels"}`` per step
to OUT/<tag>-p<process>.jsonl (pieces: the batch's provenance; input_ids and labels: the
tensors as lists, or None where the rank did not ask for them) and writes
OUT/<tag>-p<process>.json at the end of a loop (its resume mode, step, storage counters and
state digest).
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh

from streamforge import PackedTokenDataset, Stream, StreamingLoader
from streamforge.errors import ConfigError

SAVE_AT, STEPS = 4, 6


class LoaderState(Stateful):
    def __init__(self, loader):
        self.loader = loader

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


def dataset(urls, **topology):
    streams = [Stream(u, weight=w, name=f"s{i}") for i, (u, w) in enumerate(zip(urls, [0.7, 0.3]))]
    return PackedTokenDataset(streams, seq_len=32, shuffle_buffer=16, provenance=True, **topology)


def loop(out: Path, tag: str, loader, steps: int = 0, save_at: int = 0, dp_group=None, ckpt=None) -> None:
    me, topo = dist.get_rank(), loader.dataset.topology
    rows = open(out / f"{tag}-p{me}.jsonl", "w")
    drop_bound = loader.plan().drop_bound()
    for batch in loader:
        step = loader.step - 1
        pieces = batch["segments"].reshape(-1, 5)
        row = {"step": step, "dp": topo.rank, "replica": topo.replica,
               "pieces": pieces[pieces[:, 0] >= 0].tolist(),
               "input_ids": batch["input_ids"].tolist() if "input_ids" in batch else None,
               "labels": batch["labels"].tolist() if "labels" in batch else None}
        rows.write(json.dumps(row) + "\n")
        grad = torch.tensor([float(len(row["pieces"]))])
        dist.all_reduce(grad, group=dp_group)  # what DDP does after every step
        if save_at and step + 1 == save_at:
            dcp.save({"loader": LoaderState(loader)}, checkpoint_id=str(ckpt))
        if steps and step + 1 == steps:
            break
    rows.close()
    stats = loader.stats()
    report = {"dp": topo.rank, "dp_size": topo.world_size, "replica": topo.replica, "replicas": topo.replicas,
              "step": loader.step, "drop_bound": drop_bound, "bytes_fetched": fetched(loader), "index_bytes": index_bytes(loader),
              "resume": None if loader.resume_report is None else loader.resume_report.mode,
              "digest": loader.state_dict()["digest"], "reads_storage": stats.get("replica", {}).get("reads_storage")}
    (out / f"{tag}-p{me}.json").write_text(json.dumps(report))


def fetched(loader) -> int:
    """Bytes this process's pipelines fetched from storage (``stats()``)."""
    return sum(s.get("bytes_fetched", 0) for s in loader.stats()["streams"].values())


def index_bytes(loader) -> int:
    """Bytes of the record indexes the planner read in this process (to cut the plan)."""
    return sum(src.stats().get("bytes_fetched", 0) for src in loader.dataset._index_sources.values())


def errors(urls, mesh) -> dict[str, str]:
    """Every bad configuration of a hybrid-parallel loader, each one's message."""
    got = {}
    cases = {
        "no_dp_dim": lambda: dataset(urls, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "tp"))),
        "unknown_dim": lambda: dataset(urls, mesh=mesh, dp_dims=("data",)),
        "tp_as_dp": lambda: dataset(urls, mesh=mesh, dp_dims=("tp",)),
        "mesh_and_rank": lambda: dataset(urls, mesh=mesh, rank=0, world_size=2),
        "group_size": lambda: dataset(urls, group=megatron_group(), world_size=4),
        "replicas_differ": lambda: StreamingLoader(dataset(urls, mesh=mesh), batch_size=2,
                                                   read_once=mesh["tp"].get_local_rank() == 0),
    }
    for name, make in cases.items():
        try:
            make()
            got[name] = "no error"
        except ConfigError as exc:
            got[name] = str(exc)
    return got


_groups: dict = {}


def megatron_group():
    """The data-parallel group of this process, made as Megatron's mpu does (tp fastest)."""
    world, tp = dist.get_world_size(), int(os.environ["MESH_TP"])
    if not _groups:
        for t in range(tp):
            _groups[t] = dist.new_group(list(range(t, world, tp)))
    return _groups[dist.get_rank() % tp]


def main(out: Path, mode: str, dp: int, tp: int, urls: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    os.environ["MESH_TP"] = str(tp)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_group = mesh["dp"].get_group()
    ckpt = out / "ckpt"
    if mode == "run":  # with a ledger: one writer per data-parallel rank, whatever the replicas
        loader = StreamingLoader(dataset(urls, mesh=mesh), batch_size=2, num_workers=1, ledger_dir=str(out / "ledger"))
        loop(out, f"run-{dp}x{tp}", loader, save_at=SAVE_AT, dp_group=dp_group, ckpt=ckpt)
    elif mode == "resume":
        loader = StreamingLoader(dataset(urls, mesh=mesh), batch_size=2, num_workers=1)
        dcp.load({"loader": LoaderState(loader)}, checkpoint_id=str(ckpt))
        loop(out, f"resume-{dp}x{tp}", loader, dp_group=dp_group)
    elif mode == "variants":
        stage = {} if mesh["tp"].get_local_rank() == 0 else {"fields": ("labels",)}
        loader = StreamingLoader(dataset(urls, mesh=mesh), batch_size=2, num_workers=1, read_once=True, **stage)
        loop(out, "read_once", loader, steps=STEPS, dp_group=dp_group)
        del loader
        loader = StreamingLoader(dataset(urls, group=megatron_group()), batch_size=2, num_workers=1)
        loop(out, "megatron", loader, steps=STEPS, dp_group=megatron_group())
        del loader
        (out / f"errors-p{dist.get_rank()}.json").write_text(json.dumps(errors(urls, mesh)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out, mode, dp, tp, *urls = sys.argv[1:]
    main(Path(out), mode, int(dp), int(tp), urls)
