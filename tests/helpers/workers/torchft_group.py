"""One torchft replica group (one process, under its own torchrun, gloo on CPU): trains a tiny
model on a StreamingLoader fed through FaultTolerantData, and logs every committed step's
document pieces (one JSON line a step) for the test to account for every token.

Every group also keeps the data-order ledger in one shared folder (the test checks it).

Args: corpus directory, group index, most groups, log path, lighthouse address, ledger folder.

``SF_TEST_DIE=WHERE:ALONE`` makes this launch kill itself (SIGKILL, by its own pid) once it has
trained 4 steps beside the other group, after having trained alone ALONE times since it first
trained beside it: WHERE "mid" in
the next step, after its gradients are reduced and before the commit; "between" right after
the 4th step's commit and log line. A kill at a moment the trainer picks, where an outside kill
would land anywhere: in the instant between torchft's commit and the log line, the log would
miss a step the ledger holds."""

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torchft import Manager, ProcessGroupGloo

from helpers.pipeline import dataset
from streamforge import StreamingLoader
from streamforge.integrations.torchft import FaultTolerantData


def build(corpus, group, groups, ledger_dir=None):
    """The loader of every group (the test rebuilds it to read the final state)."""
    names = sorted(p.name for p in Path(corpus).iterdir())
    ds = dataset({n: (str(Path(corpus) / n), None) for n in names}, [0.6, 0.4], seq_len=32, shuffle_buffer=8,
                 provenance=True, rank=group, world_size=groups)
    return StreamingLoader(ds, batch_size=1, num_workers=1, ledger_dir=ledger_dir)


def main(corpus, group, groups, log_path, lighthouse, ledger_dir):
    Path(f"{log_path}.pid").write_text(str(os.getpid()))  # the test kills this process by its pid
    loader = build(corpus, group, groups, ledger_dir)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 1000))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), load_state_dict=model.load_state_dict,
        state_dict=model.state_dict, min_replica_size=1, use_async_quorum=False, replica_id=f"group{group}",
        lighthouse_addr=lighthouse, hostname="127.0.0.1", timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=10),
    )
    data = FaultTolerantData(loader, manager)
    die = os.environ.get("SF_TEST_DIE")
    where, alone_needed = (die.split(":")[0], int(die.split(":")[1])) if die else (None, 0)
    together = alone = beside = 0
    with open(log_path, "a") as log:
        for batch in data:
            step = manager.current_step()
            logits = model(batch["input_ids"])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            loss.backward()
            for p in model.parameters():
                manager.allreduce(p.grad).wait()
            if where == "mid" and together >= 4:
                os.kill(os.getpid(), signal.SIGKILL)
            if data.should_commit():  # the manager's, with the commit in the ledger
                optimizer.step()
                seg = batch["segments"].reshape(-1, 5)
                log.write(json.dumps({"step": step, "group": group, "rank": manager.participating_rank(),
                                      "n": manager.num_participants(),
                                      "pieces": seg[seg[:, 0] >= 0].tolist()}) + "\n")
                log.flush()
                if manager.num_participants() > 1:
                    beside += 1
                    together += alone >= alone_needed
                elif beside:  # alone after having trained beside the other group
                    alone, together = alone + 1, 0
                if where == "between" and together >= 4:
                    os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            time.sleep(0.05 if manager.num_participants() > 1 else 0.4)  # alone: slower, so a group can rejoin
        log.write(json.dumps({"end": loader.step, "group": group, "state": loader.state_dict()}) + "\n")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
