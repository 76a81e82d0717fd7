"""A tiny model trained with Hugging Face accelerate under torchrun (2 CPU processes, gloo).

    accelerate_worker.py OUT PHASE URL...

PHASE ``run``: 12 steps, ``save_state`` after step 5; ``resume``: ``load_state`` then on to
step 12; ``refuse``: ``accelerator.prepare(DataLoader(PackedTokenDataset))`` iterated, the error
recorded. Every process appends ``{"step", "ids", "loss"}`` per step to
OUT/<phase>-rank<r>.jsonl and writes OUT/<phase>-report-rank<r>.json.
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from streamforge import PackedTokenDataset, Stream, StreamingLoader
from streamforge.errors import ConfigError
from streamforge.integrations.accelerate import prepare

STEPS, SAVE_AT = 12, 5


def main(out: Path, phase: str, urls: list[str]) -> None:
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    streams = [Stream(u, weight=w, name=f"s{i}") for i, (u, w) in enumerate(zip(urls, [0.7, 0.3]))]
    dataset = PackedTokenDataset(streams, seq_len=32, shuffle_buffer=8)
    report: dict = {}
    if phase == "refuse":  # accelerate's default (dispatch), then sharding in a worker process
        for case, dispatch, workers in (("dispatch", None, 0), ("shard", False, 1)):
            accelerator.dataloader_config.dispatch_batches = dispatch
            try:
                fresh = PackedTokenDataset(streams, seq_len=32, shuffle_buffer=8)
                next(iter(accelerator.prepare(DataLoader(fresh, batch_size=2, num_workers=workers))))
                report[case] = "no error"
            except ConfigError as exc:
                report[case] = str(exc)
        (out / f"{phase}-report-rank{rank}.json").write_text(json.dumps(report))
        return
    loader = prepare(accelerator, StreamingLoader(dataset, batch_size=2, num_workers=1, device="cpu"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 16), torch.nn.Linear(16, 1000))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    if phase == "resume":
        accelerator.load_state(str(out / "ckpt"))
    rows = open(out / f"{phase}-rank{rank}.jsonl", "w")
    for batch in loader:
        step = loader.step - 1
        loss = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten())
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        rows.write(json.dumps({"step": step, "ids": batch["input_ids"].tolist(), "loss": loss.item()}) + "\n")
        if phase == "run" and step + 1 == SAVE_AT:
            accelerator.save_state(str(out / "ckpt"))
        if step + 1 == STEPS:
            break
    rows.close()
    report = {"rank": dataset.rank, "world_size": dataset.world_size, "step": loader.step,
              "resume": None if loader.resume_report is None else loader.resume_report.mode}
    (out / f"{phase}-report-rank{rank}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
