"""A digest of every batch streamforge hands out in five jobs, to show that a change which
should not change the data order did not.

    python tools/batch_digest.py                      # print the digests (JSON)
    python tools/batch_digest.py --save digests.json  # keep them
    python tools/batch_digest.py --check digests.json # exit 1, naming the jobs, if any differs

The jobs read one small corpus the tool writes itself (three streams of lognormal documents,
fixed seeds) through the public API only, so the same script runs on any commit:

* ``w0``, ``w2``: a whole pass with 0 and with 2 workers, weights 0.5/0.3/0.2;
* ``schedule``: a mixture schedule that switches weights at step 20, 2 workers, two passes;
* ``elastic``: two ranks of one worker save at step 15, their states are merged and the rest
  of the pass resumes on one rank of two workers with another batch size (``elastic``);
* ``eval``: an evaluation pass over the same streams on rank 1 of 2.

Each digest is the SHA-256 over every batch's tensors (name, dtype, shape, bytes) in order,
with the number of batches and the loader's step after the pass.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import numpy as np


def write_corpus(root: str) -> list:
    from streamforge import ShardWriter, Stream

    rng = np.random.default_rng(1234)
    streams = []
    for name, n, median in (("web", 300, 60), ("code", 80, 200), ("books", 20, 700)):
        url = os.path.join(root, name)
        with ShardWriter(url, shard_size="8KiB", frame_size="2KiB", eos_id=0) as writer:
            for length in np.maximum(0, rng.lognormal(np.log(median), 1.0, size=n).astype(int)):
                writer.write(rng.integers(1, 1000, size=int(length)).astype(np.uint16))
        streams.append(Stream(url, name=name))
    return streams


class Digest:
    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.batches = 0

    def add(self, batch) -> None:
        for key in sorted(batch):
            tensor = batch[key].contiguous().cpu()
            self.h.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            self.h.update(tensor.numpy().tobytes())
        self.batches += 1

    def result(self, step: int | None) -> dict:
        return {"sha256": self.h.hexdigest(), "batches": self.batches, "step": step}


def _dataset(streams, **kwargs):
    from streamforge import PackedTokenDataset, Stream

    weights = kwargs.pop("stream_weights", (0.5, 0.3, 0.2))
    streams = [Stream(s.url, weight=w, name=s.name) for s, w in zip(streams, weights)]
    kwargs.setdefault("seq_len", 64)
    kwargs.setdefault("shuffle_buffer", 32)
    kwargs.setdefault("shuffle_warmup", 4)
    return PackedTokenDataset(streams, seed=3, provenance=True, **kwargs)


def job_pass(streams, num_workers: int) -> dict:
    from streamforge import StreamingLoader

    loader = StreamingLoader(_dataset(streams), batch_size=2, num_workers=num_workers)
    digest = Digest()
    for batch in loader:
        digest.add(batch)
    return digest.result(loader.step)


def job_schedule(streams) -> dict:
    from streamforge import StreamingLoader

    weights = [(0, {"web": 0.8, "code": 0.1, "books": 0.1}), (20, {"web": 0.2, "code": 0.4, "books": 0.4})]
    loader = StreamingLoader(_dataset(streams, weights=weights), batch_size=2, num_workers=2)
    digest = Digest()
    for _ in range(2):
        for batch in loader:
            digest.add(batch)
    return digest.result(loader.step)


def job_elastic(streams) -> dict:
    from streamforge import StreamingLoader, merge_states

    states = []
    for rank in range(2):
        loader = StreamingLoader(_dataset(streams, rank=rank, world_size=2), batch_size=2, num_workers=1)
        for i, _ in enumerate(loader):
            if i + 1 == 15:
                break
        states.append(loader.state_dict())
    resumed = StreamingLoader(_dataset(streams, rank=0, world_size=1), batch_size=3, num_workers=2)
    resumed.load_state_dict(merge_states(states))
    digest = Digest()
    for batch in resumed:
        digest.add(batch)
    out = digest.result(resumed.step)
    out["mode"] = resumed.resume_report.mode
    return out


def job_eval(streams) -> dict:
    from streamforge import StreamingLoader

    ds = _dataset(streams, rank=1, world_size=2, evaluation=True, stream_weights=(1.0, 1.0, 1.0),
                  shuffle_buffer=8192, shuffle_warmup=256)
    digest = Digest()
    for batch in StreamingLoader(ds, batch_size=2):
        digest.add(batch)
    return digest.result(None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", help="write the digests to this JSON file")
    parser.add_argument("--check", help="compare with the digests in this JSON file; exit 1 on a difference")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batch-digest-") as root:
        streams = write_corpus(root)
        jobs = {
            "w0": lambda: job_pass(streams, 0),
            "w2": lambda: job_pass(streams, 2),
            "schedule": lambda: job_schedule(streams),
            "elastic": lambda: job_elastic(streams),
            "eval": lambda: job_eval(streams),
        }
        digests = {}
        for name, job in jobs.items():
            digests[name] = job()
            print(f"{name:9s} {digests[name]}", file=sys.stderr)
    print(json.dumps(digests, indent=1))
    if args.save:
        with open(args.save, "w") as f:
            json.dump(digests, f, indent=1)
    if args.check:
        with open(args.check) as f:
            want = json.load(f)
        differ = [name for name in want if want[name] != digests.get(name)]
        if differ:
            print(f"batch_digest: {len(differ)} job(s) differ: {differ}", file=sys.stderr)
            return 1
        print(f"batch_digest: all {len(want)} jobs give the same batches", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
