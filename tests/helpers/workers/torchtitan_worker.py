"""A torchtitan training loop under torchrun (gloo, CPU): ``StreamforgeDataLoader`` built from
its ``Config`` as torchtitan's trainer builds it, checkpointed by torchtitan's own
``CheckpointManager`` with a tiny model, its ``OptimizersContainer`` and
``LRSchedulersContainer``. torchtitan's ``Trainer`` needs CUDA; this is its loop without it.

    torchtitan_worker.py OUT MODE DP REPLICAS URL...

The job has DP x REPLICAS processes; the replicas of a data-parallel rank are consecutive
(as torchtitan's tensor-parallel dimension, the fastest of its mesh): process p is dp_rank
p // REPLICAS. The loader is told only dp_rank and dp_world_size, as torchtitan tells it.

MODE:
* ``run``: a fresh start, STEPS steps; the CheckpointManager saves OUT/ckpt/step-SAVE_AT
  (its interval) and OUT/ckpt/step-STEPS (the last step, model only);
* ``resume``: load OUT/ckpt/step-SAVE_AT and train on to step STEPS;
* ``drain``: load OUT/ckpt/step-SAVE_AT and train until the loader ends (its one pass).

The loader keeps a data-order ledger in OUT/ledger. Every process writes
OUT/<MODE>-p<process>.jsonl, one row per step (``step``, ``dp``, ``input``, ``positions``,
``labels``, ``loss``), and OUT/<MODE>-p<process>.json at the end (the resume mode, the
loader's step, the digest of its state, the trainer's step).
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from streamforge.integrations.torchtitan import StreamforgeDataLoader

SAVE_AT, STEPS, SEQ_LEN, BATCH, VOCAB = 4, 8, 32, 2, 1000


class TrainState(Stateful):
    """What torchtitan's Trainer saves as ``train_state``: the step."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


class Tiny(torch.nn.Module):
    """Token and position embeddings and an output head: the loss depends on all three inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, 16)
        self.pos = torch.nn.Embedding(SEQ_LEN, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, tokens, positions):
        return self.head(self.tok(tokens) + self.pos(positions))


def main(out: Path, mode: str, dp: int, replicas: int, urls: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    me = dist.get_rank()
    assert dist.get_world_size() == dp * replicas
    dp_rank = me // replicas
    config = StreamforgeDataLoader.Config(streams=urls, weights=[0.7, 0.3], names=["web", "code"], seed=1,
                                          shuffle_buffer=16, shuffle_warmup=4, num_workers=1, passes=1,
                                          ledger=str(out / "ledger"))
    loader = config.build(dp_world_size=dp, dp_rank=dp_rank, tokenizer=None, seq_len=SEQ_LEN,
                          local_batch_size=BATCH, snapshot_every_n_steps=SAVE_AT)
    torch.manual_seed(0)  # the same model on every process
    model = Tiny()
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    state = TrainState()
    checkpointer = CheckpointManager.Config(enable=True, folder="ckpt", interval=SAVE_AT, keep_latest_k=0).build(
        dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None, base_folder=str(out))
    checkpointer.load(step=-1 if mode == "run" else SAVE_AT)
    last = STEPS if mode != "drain" else 10**6
    rows = open(out / f"{mode}-p{me}.jsonl", "w")
    batches = iter(loader)
    while state.step < last:
        try:
            inputs, labels = next(batches)
        except StopIteration:  # torchtitan's trainer stops there too (DataloaderExhaustedError)
            break
        state.step += 1
        optimizers.zero_grad()
        logits = model(inputs["input"], inputs["positions"])
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        for p in model.parameters():  # what data parallelism does: one model on every process
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizers.step()
        schedulers.step()
        rows.write(json.dumps({"step": state.step, "dp": dp_rank, "input": inputs["input"].tolist(),
                               "positions": inputs["positions"].tolist(), "labels": labels.tolist(),
                               "loss": loss.item()}) + "\n")
        if mode != "drain":
            checkpointer.save(state.step, last_step=state.step == STEPS)
    rows.close()
    report = {"dp": dp_rank, "step": state.step, "loader_step": loader.step,
              "resume": None if loader.resume_report is None else loader.resume_report.mode,
              "digest": loader.state_dict()["digest"], "device": str(inputs["input"].device),
              "dtypes": [str(inputs["input"].dtype), str(inputs["positions"].dtype), str(labels.dtype)]}
    (out / f"{mode}-p{me}.json").write_text(json.dumps(report))
    checkpointer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
