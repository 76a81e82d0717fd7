"""Train a tiny model under torchrun (gloo, CPU) with model, optimizer and loader checkpointed
together through torch.distributed.checkpoint (DCP), as one ``Stateful`` train state.

    dcp_worker.py OUT CKPT MODE STEPS SAVE_AT KILL_AT URL...

MODE "run" trains from scratch to STEPS (0: the end of the pass), saving at step SAVE_AT; with
KILL_AT > 0 every rank SIGKILLs itself once step KILL_AT is done (a crashed job). MODE "resume"
loads the checkpoint into a fresh model, optimizer and loader (on any number of ranks) and
trains on to STEPS. Each rank appends ``{"step", "loss", "pieces"}`` per step to
OUT/losses-<mode>-rank<r>.jsonl (flushed each step; pieces: the batch's provenance, stream,
shard, record, token_start, length) and writes OUT/report-<mode>-rank<r>.json at the end.
"""

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from streamforge import PackedTokenDataset, Stream, StreamingLoader


class TrainState(Stateful):
    """Model, optimizer and data order under one key."""

    def __init__(self, model, optimizer, loader):
        self.model, self.optimizer, self.loader = model, optimizer, loader

    def state_dict(self):
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim, "loader": self.loader.state_dict()}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.loader.load_state_dict(state["loader"])


def main(out: Path, ckpt: str, mode: str, steps: int, save_at: int, kill_at: int, urls: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    streams = [Stream(u, weight=w, name=f"s{i}") for i, (u, w) in enumerate(zip(urls, [0.7, 0.3]))]
    dataset = PackedTokenDataset(streams, seq_len=64, shuffle_buffer=32, provenance=True)
    loader = StreamingLoader(dataset, batch_size=2, num_workers=1, ledger_dir=str(out / "ledger"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 16), torch.nn.Linear(16, 1000))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = TrainState(model, optimizer, loader)
    if mode == "resume":
        app = {"train": state}
        dcp.load(app, checkpoint_id=ckpt)
    losses = open(out / f"losses-{mode}-rank{rank}.jsonl", "w")
    drop_bound = loader.plan().drop_bound()
    for batch in loader:
        step = loader.step - 1  # the global step of this batch
        logits = ddp(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        pieces = batch["segments"].reshape(-1, 5)
        pieces = pieces[pieces[:, 0] >= 0].tolist()
        losses.write(json.dumps({"step": step, "loss": loss.item(), "pieces": pieces}) + "\n")
        losses.flush()
        if mode == "run" and step + 1 == save_at:
            dcp.save({"train": state}, checkpoint_id=ckpt)
        if kill_at and step + 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step + 1 == steps:
            break
    report = {"rank": rank, "world": dist.get_world_size(), "step": loader.step, "drop_bound": drop_bound,
              "resume": None if loader.resume_report is None else loader.resume_report.mode}
    (out / f"report-{mode}-rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    out, ckpt, mode, steps, save_at, kill_at, *urls = sys.argv[1:]
    main(Path(out), ckpt, mode, int(steps), int(save_at), int(kill_at), urls)
