"""Run under torchrun (gloo, CPU): each rank streams one pass, checks a resume, reports records."""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from streamforge import PackedTokenDataset, Stream, StreamingLoader


def build(urls):
    streams = [Stream(u, weight=w, name=f"s{i}") for i, (u, w) in enumerate(zip(urls, [0.5, 0.3, 0.2]))]
    ds = PackedTokenDataset(streams, seq_len=64, shuffle_buffer=32, provenance=True)  # rank from torch.distributed
    return StreamingLoader(ds, batch_size=2, num_workers=1)


def train_one_pass(urls):
    """The README's loop under DDP: a finite pass, gradients all-reduced at every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 16), torch.nn.Linear(16, 1000))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loader = build(urls)
    steps_before = loader.steps_per_pass
    n = 0
    for batch in loader:
        logits = ddp(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        n += 1
    done = torch.tensor([n])
    dist.all_reduce(done)  # every rank reaches this point: nobody is left waiting in a collective
    return {"batches": n, "steps_per_pass": steps_before, "step": loader.step}


def main(out: Path, urls: list[str]) -> None:
    # a short collective timeout: a rank left waiting fails fast instead of hanging the test
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if rank != 0:  # only rank 0 reads manifests; the others get them broadcast
        import streamforge.format.manifest as manifest_module

        def refuse(*args, **kwargs):
            raise AssertionError("a rank other than 0 read a manifest")

        manifest_module.Manifest.load = refuse
    batches = [b for b in build(urls)]
    segs = torch.cat([b["segments"].reshape(-1, 5) for b in batches])
    segs = segs[(segs[:, 0] >= 0) & (segs[:, 3] == 0)]
    records = segs[:, :3].tolist()
    # exact resume on every rank, from a cut in the middle
    cut = len(batches) // 2
    first = build(urls)
    it = iter(first)
    for _ in range(cut):
        next(it)
    state = first.state_dict()
    del it
    resumed = build(urls)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    tail = list(resumed)
    exact = len(tail) == len(batches) - cut and all(
        all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(tail, batches[cut:])
    )
    trained = train_one_pass(urls)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"records": records, "exact": exact, "trained": trained})
    if rank == 0:
        result = {"records": [g["records"] for g in gathered], "resume_exact": [g["exact"] for g in gathered],
                  "trained": [g["trained"] for g in gathered]}
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
