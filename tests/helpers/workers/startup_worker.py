"""Run under torchrun (gloo, CPU): one rank of a job that builds its loader and takes its first
batch from S3 through a counting proxy of its own, then marks the proxy's log.

    startup_worker.py CONFIG OUT

CONFIG (JSON): ``urls`` (one per stream), ``endpoints`` (one proxy per rank), ``key``,
``secret``, ``workers`` (num_workers), ``seq_len``, ``batch_size``, ``prefetch_bytes``, ``alone`` (true: each rank
plans on its own, as before the ranks shared their plan). Writes ``OUT/rank-R.json``.
"""

import json
import sys
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from streamforge import PackedTokenDataset, Stream, StorageConfig, StreamingLoader


def main(config: Path, out: Path) -> None:
    cfg = json.loads(config.read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    endpoint = cfg["endpoints"][rank]
    opts = {"key": cfg["key"], "secret": cfg["secret"], "client_kwargs": {"endpoint_url": endpoint},
            "skip_instance_cache": True}
    dist.barrier()
    start = time.perf_counter()
    streams = [Stream(u, weight=1.0, name=f"s{i}", storage_options=opts) for i, u in enumerate(cfg["urls"])]
    storage = StorageConfig(prefetch_bytes=cfg.get("prefetch_bytes"))
    ds = PackedTokenDataset(streams, seq_len=cfg["seq_len"], seed=0, storage=storage)
    loader = StreamingLoader(ds, batch_size=cfg["batch_size"], num_workers=cfg["workers"])
    if cfg["alone"]:
        loader.plan()  # computed by this rank alone: every cut shard's record index
    it = iter(loader)
    batch = next(it)
    seconds = time.perf_counter() - start
    with urllib.request.urlopen(endpoint + "/__proxy__/mark", timeout=30) as response:
        mark = int(response.read())
    plan = loader.plan()
    mine = range(rank * plan.workers_per_rank, (rank + 1) * plan.workers_per_rank)
    # per stream, the shards this rank's ranges hold: the only record indexes it needs, but for
    # the shard each of its own cuts falls in
    own = [sorted({r[0] for g in mine for r in ranges[g] if r[2] > r[1]}) for ranges in plan.ranges]
    result = {"rank": rank, "seconds": seconds, "mark": mark, "steps": plan.steps, "tokens": plan.tokens,
              "first_ids": batch["input_ids"][0, :8].tolist(), "own_shards": own}
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    it.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
