"""An evaluation pass of a tiny fixed model, under torchrun (gloo, CPU) or in one process.

Writes ``result.json`` (rank 0): the summed loss and token count per stream from
``StreamLoss``, the same sums computed by hand per rank and all-reduced, and each rank's
step count. Every step all-reduces a counter, as a DDP step would, so a rank with fewer
batches would hang (the collective timeout turns that into a failure).
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from streamforge import PackedTokenDataset, Stream, StreamingLoader, StreamLoss


def main(out: Path, packing: str, batch_size: int, workers: int, urls: list[str]) -> None:
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank() if distributed else 0
    streams = [Stream(u, name=f"s{i}") for i, u in enumerate(urls)]
    ds = PackedTokenDataset(streams, seq_len=64, packing=packing, evaluation=True)
    loader = StreamingLoader(ds, batch_size=batch_size, num_workers=workers)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 16), torch.nn.Linear(16, 1000)).double()
    metric = StreamLoss(ds.stream_names)
    by_hand = torch.zeros(2, len(urls), dtype=torch.float64)
    steps = 0
    with torch.no_grad():
        for batch in loader:
            per_token = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(),
                                        reduction="none")
            metric.update(per_token, batch)
            labels, source = batch["labels"].flatten(), batch["source_ids"].flatten()
            for s in range(len(urls)):
                mask = (labels != -100) & (source == s)
                by_hand[0, s] += per_token[mask].sum()
                by_hand[1, s] += mask.sum()
            steps += 1
            if distributed:
                dist.all_reduce(torch.ones(1))  # a collective per step, as DDP has
    sums, counts = metric.totals()
    if distributed:
        dist.all_reduce(by_hand)
        all_steps = [None] * dist.get_world_size()
        dist.all_gather_object(all_steps, (steps, loader.steps_per_pass))
    else:
        all_steps = [(steps, loader.steps_per_pass)]
    result = {"sums": sums.tolist(), "counts": counts.tolist(), "by_hand": by_hand.tolist(),
              "means": metric.compute(), "steps": all_steps}
    if rank == 0:
        (out / "result.json").write_text(json.dumps(result))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
