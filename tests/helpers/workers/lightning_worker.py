"""A tiny model trained by PyTorch Lightning on 2 CPU processes (gloo), fed by streamforge.

    lightning_worker.py OUT STRATEGY MODE WORKERS PHASE URL...

STRATEGY is ``ddp`` or ``ddp_spawn``; MODE ``finite`` or ``infinite``; WORKERS the loader's
``num_workers``; PHASE ``run`` (12 steps from scratch, a checkpoint after step 5) or
``resume`` (``fit(ckpt_path=OUT/ckpt/step=5.ckpt)`` on to step 12). The dataset is built in
the DataModule's ``__init__``, before the process group exists, as Lightning's docs do.
Every process appends ``{"step", "rank", "ids", "loss"}`` per training step to
OUT/<phase>-rank<r>.jsonl and writes OUT/<phase>-report-rank<r>.json at the end (its
topology, the loader's resume mode and step).
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from streamforge import PackedTokenDataset, Stream, StreamingLoader
from streamforge.integrations.lightning import LightningLoader

MAX_STEPS, SAVE_EVERY = 12, 5


class Data(L.LightningDataModule):
    def __init__(self, urls, infinite, workers):
        super().__init__()
        streams = [Stream(u, weight=w, name=f"s{i}") for i, (u, w) in enumerate(zip(urls, [0.7, 0.3]))]
        self.dataset = PackedTokenDataset(streams, seq_len=32, shuffle_buffer=8, infinite=infinite)
        self.workers = workers
        self.loader = None

    def train_dataloader(self):
        self.loader = StreamingLoader(self.dataset, batch_size=2, num_workers=self.workers, device="cpu")
        # a finite loader as it is (its length stops Lightning's look-ahead); an infinite one wrapped
        return LightningLoader(self.loader) if self.loader.infinite else self.loader


class Model(L.LightningModule):
    def __init__(self, out, phase):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Embedding(1000, 16), torch.nn.Linear(16, 1000))
        self.out, self.phase = str(out), phase

    def training_step(self, batch, batch_idx):
        logits = self.net(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        row = {"step": int(self.global_step), "rank": self.global_rank,
               "ids": batch["input_ids"].tolist(), "loss": loss.item()}
        with open(Path(self.out) / f"{self.phase}-rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_end(self):
        loader = self.trainer.datamodule.loader
        topology = loader.dataset.topology
        report = {"rank": topology.rank, "world_size": topology.world_size, "source": topology.source,
                  "resume": None if loader.resume_report is None else loader.resume_report.mode,
                  "step": loader.step}
        (Path(self.out) / f"{self.phase}-report-rank{self.global_rank}.json").write_text(json.dumps(report))


def main(out, strategy, mode, workers, phase, urls):
    data = Data(urls, mode == "infinite", workers)
    model = Model(out, phase)
    checkpoints = ModelCheckpoint(dirpath=str(out / "ckpt"), filename="{step}", every_n_train_steps=SAVE_EVERY,
                                  save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=MAX_STEPS, logger=False,
                        callbacks=[checkpoints], enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    ckpt = str(out / "ckpt" / f"step={SAVE_EVERY}.ckpt") if phase == "resume" else None
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)


if __name__ == "__main__":
    out, strategy, mode, workers, phase, *urls = sys.argv[1:]
    main(Path(out), strategy, mode, int(workers), phase, urls)
