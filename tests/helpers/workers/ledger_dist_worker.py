"""Run under torchrun (gloo, CPU): every rank keeps a ledger, is "killed" past a checkpoint and
restarted from it; the ranks of each restart must agree on one generation number."""

import sys
import time
from datetime import timedelta

import torch.distributed as dist

from streamforge import PackedTokenDataset, Stream, StreamingLoader


def build(urls, ledger_dir, num_workers=1):
    streams = [Stream(u, name=f"s{i}") for i, u in enumerate(urls)]
    ds = PackedTokenDataset(streams, seq_len=64, shuffle_buffer=32)  # rank from torch.distributed
    return StreamingLoader(ds, batch_size=2, num_workers=num_workers, ledger_dir=ledger_dir)


def main(ledger_dir: str, urls: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    first = build(urls, ledger_dir)
    it = iter(first)
    for _ in range(10):
        next(it)
    state = first.state_dict()
    if dist.get_rank() == 0:  # rank 0 gets further before the job dies: its tail is flushed
        for _ in range(5):
            next(it)
    first.ledger.close()
    del it
    dist.barrier()
    resumed = build(urls, ledger_dir, num_workers=0)  # one logical worker either way: exact
    if dist.get_rank() == 1:  # a slow rank: without the all-reduce, rank 0's first chunk of the
        time.sleep(1.5)  # restart would be on storage before rank 1 lists, and it would take 2
    resumed.load_state_dict(state)
    it = iter(resumed)
    next(it)
    resumed.state_dict()  # rank 0 writes its first chunk of the restart at once
    for _ in it:
        pass
    resumed.state_dict()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
