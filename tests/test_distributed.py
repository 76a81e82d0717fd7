"""Multi-rank runs: every record read exactly once across (rank, worker) pairs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.pipeline import dataset, loader, make_corpus, take
from helpers.s3_server import free_port

WORKER = Path(__file__).parent / "helpers" / "workers" / "dist_worker.py"


def _records(batches):
    segs = torch.cat([b["segments"].reshape(-1, 5) for b in batches])
    segs = segs[(segs[:, 0] >= 0) & (segs[:, 3] == 0)]
    return [tuple(x) for x in segs[:, :3].tolist()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("dist"), np.random.default_rng(3))


def _all_records(corpus):
    from streamforge import Manifest

    out = set()
    for i, (url, docs) in enumerate(corpus.values()):
        m = Manifest.load(url)
        k = 0
        for shard, n in enumerate(m.columns["num_records"].tolist()):
            for r in range(n):
                if len(docs[k]):
                    out.add((i, shard, r))
                k += 1
    return out


@pytest.mark.parametrize("world_size,num_workers", [(2, 2), (3, 1), (4, 0)])
def test_simulated_ranks_read_each_record_once(corpus, world_size, num_workers):
    seen, counts, tokens, dropped = [], [], 0, 0
    for rank in range(world_size):
        ds = dataset(corpus, provenance=True, rank=rank, world_size=world_size)
        ldr = loader(ds, num_workers=num_workers)
        batches = take(ldr)
        counts.append(len(batches))
        seen += _records(batches)
        tokens += sum(int((b["doc_ids"] >= 0).sum()) for b in batches)
        dropped += ldr.stats()["dropped_tokens"]
    assert len(set(counts)) == 1, f"ranks yielded {counts} batches"
    assert len(seen) == len(set(seen)), "a record was read by two workers"
    assert set(seen) <= _all_records(corpus)
    total = sum(len(d) + 1 for _, docs in corpus.values() for d in docs if len(d))
    assert tokens + dropped == total


def test_torchrun_gloo_two_ranks(corpus, tmp_path):
    urls = [url for url, _ in corpus.values()]
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(WORKER), str(out), *urls]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    seen = [tuple(r) for rank in result["records"] for r in rank]
    assert len(seen) == len(set(seen))
    assert set(seen) <= _all_records(corpus)
    assert result["resume_exact"] == [True, True]
    # the DDP pass: both ranks took the same number of steps, announced before the first
    trained = result["trained"]
    assert trained[0] == trained[1], trained
    assert trained[0]["batches"] == trained[0]["steps_per_pass"] == trained[0]["step"] > 0
