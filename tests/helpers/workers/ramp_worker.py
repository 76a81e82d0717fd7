"""Run under torchrun (gloo, CPU): a finite pass with a batch-size ramp and a seq_len warmup,
an all-reduce at every step, then an exact resume from the middle of the ramp; reports each
rank's steps and what the all-reduces saw."""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from streamforge import PackedTokenDataset, Stream, StreamingLoader

BATCHES = [(0, 2), (4, 3), (9, 5)]
SEQ_LENS = [(0, 32), (7, 48)]


def build(urls):
    streams = [Stream(u, weight=w, name=f"s{i}") for i, (u, w) in enumerate(zip(urls, [0.6, 0.4]))]
    # the rank comes from torch.distributed
    ds = PackedTokenDataset(streams, seq_len=SEQ_LENS, shuffle_buffer=16, provenance=True)
    return StreamingLoader(ds, batch_size=BATCHES, num_workers=2)


def one_pass(loader, until=None):
    """Batches to the end of the pass (or to step ``until``), an all-reduce per step: the
    tokens of the step's batch, summed over ranks, and the shape every rank must share."""
    seen = []
    for batch in loader:
        step = loader.step - 1
        rows, seq_len = batch["input_ids"].shape
        shape = torch.tensor([rows, seq_len, rows * seq_len])
        low, high = shape.clone(), shape.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        seen.append({"step": step, "shape": [rows, seq_len], "same": bool(torch.equal(low, high)),
                     "scheduled": [loader.batch_sizes.at(step), loader.dataset.seq_lens.at(step)],
                     "tokens": batch["input_ids"].sum().item()})
        if until is not None and loader.step >= until:
            break
    return seen


def main(out: Path, urls: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    loader = build(urls)
    steps_before = loader.steps_per_pass
    full = one_pass(loader)
    done = torch.tensor([len(full)])
    dist.all_reduce(done)  # every rank reaches this: nobody is left waiting in a collective
    # exact resume from inside the ramp (between the batch-size switches, after the seq_len one)
    first = build(urls)
    head = one_pass(first, until=8)
    state = json.loads(json.dumps(first.state_dict()))  # gathered from both ranks
    resumed = build(urls)
    resumed.load_state_dict(state, strict=True)
    resumed_first = [resumed.step, resumed.batch_size, resumed.seq_len]
    tail = one_pass(resumed)
    report = {"steps_per_pass": steps_before, "steps": len(full), "step": loader.step, "full": full,
              "resumed": head + tail, "resumed_first": resumed_first, "mode": resumed.resume_report.mode}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if rank == 0:
        (out / "result.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
