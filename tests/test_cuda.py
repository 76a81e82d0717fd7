"""On a CUDA rank, batches arrive pinned-then-copied onto the rank's device."""

import numpy as np
import pytest
import torch

from pipeline_helpers import dataset, loader, make_corpus, take

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CI and the CPU test machines have none)"
)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_arrive_on_the_device(tmp_path, num_workers):
    corpus = make_corpus(tmp_path, np.random.default_rng(0))
    ldr = loader(dataset(corpus), num_workers=num_workers)
    assert ldr.pin_memory and ldr.device.type == "cuda"
    batches = take(ldr, 5)
    for batch in batches:
        assert all(v.device == ldr.device for v in batch.values())
    cpu = take(loader(dataset(corpus), num_workers=num_workers, device="cpu"), 5)
    for a, b in zip(batches, cpu):
        assert all(torch.equal(a[k].cpu(), b[k]) for k in a)
