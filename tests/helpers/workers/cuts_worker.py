"""Run under torchrun (gloo, CPU): each rank streams one finite pass with record cuts, then
with token cuts, and reports what it delivered and dropped."""

import json
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch.distributed as dist

from streamforge import PackedTokenDataset, Stream, StreamingLoader


def one_pass(urls, cuts):
    streams = [Stream(u, weight=1.0, name=f"s{i}") for i, u in enumerate(urls)]
    ds = PackedTokenDataset(streams, seq_len=64, shuffle_buffer=64, provenance=True, cuts=cuts)
    loader = StreamingLoader(ds, batch_size=2, num_workers=2)
    plan = loader.plan()
    pieces, delivered, batches = [], 0, 0
    for batch in loader:
        segs = batch["segments"].numpy().reshape(-1, 5)
        pieces.append(segs[segs[:, 0] >= 0])
        delivered += int((batch["doc_ids"] >= 0).sum())
        batches += 1
    whole = sum(plan.tokens) + sum(plan.unassigned or ())
    return {"cuts": cuts, "steps": plan.steps, "batches": batches, "delivered": delivered,
            "dropped": loader.stats()["dropped_tokens"], "plan_dropped": plan.dropped_tokens(),
            "bound": plan.drop_bound(), "whole": whole, "pieces": np.concatenate(pieces).tolist()}


def main(out: Path, urls: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    report = {"rank": rank, "world": dist.get_world_size(), "runs": [one_pass(urls, c) for c in ("records", "tokens")]}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
