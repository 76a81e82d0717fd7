"""Datasets built before the process group, and topologies that disagree with it, under
torchrun (2 gloo processes).

    topology_worker.py OUT URL...

Each process writes OUT/topology-p<rank>.json: for every case, what happened (the rank and
world size the loader read the corpus as, its first batch's pieces, or the ConfigError).
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from streamforge import PackedTokenDataset, StreamingLoader
from streamforge.errors import ConfigError


def first(dataset) -> dict:
    loader = StreamingLoader(dataset, batch_size=2)
    try:
        batch = next(iter(loader))
    except ConfigError as exc:
        return {"error": str(exc)}
    topology = dataset.topology
    return {"rank": topology.rank, "world_size": topology.world_size, "source": topology.source,
            "tokens": batch["input_ids"].tolist()}


def main(out: Path, urls: list[str]) -> None:
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE")}
    results: dict = {}
    # built before the group, as a Lightning DataModule's __init__ is: no environment at all,
    # and the environment half set (WORLD_SIZE, not yet RANK)
    early = {"no_env": PackedTokenDataset(urls, seq_len=16)}
    os.environ["WORLD_SIZE"] = env["WORLD_SIZE"]
    early["world_size_only"] = PackedTokenDataset(urls, seq_len=16)
    results["pending_source"] = early["world_size_only"].topology.source
    # no group yet: WORLD_SIZE without RANK
    results["half_env_without_group"] = first(PackedTokenDataset(urls, seq_len=16)).get("error", "no error")
    os.environ.update(env)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for name, dataset in early.items():
        results[name] = first(dataset)
    results["after_group"] = first(PackedTokenDataset(urls, seq_len=16))
    explicit = {"wrong_rank": dict(rank=0, world_size=2), "wrong_world": dict(rank=0, world_size=1)}
    for name, topology in explicit.items():
        results[name] = first(PackedTokenDataset(urls, seq_len=16, **topology))
    (out / f"topology-p{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
