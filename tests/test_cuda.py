"""On a CUDA rank, batches arrive on the rank's device, copied ahead on a side stream.

Everything here needs a CUDA device and skips without one (CI and the CPU test machines have
none); the prefetch logic itself (state of the handed-out batch, exact resume, thread
shutdown) is tested on CPU in test_device.py. ``tools/gpu_check.py`` measures the overlap.
"""

import json

import numpy as np
import pytest
import torch

from helpers.pipeline import assert_batches_equal, dataset, loader, make_corpus, take

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CI and the CPU test machines have none)"
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("cuda"), np.random.default_rng(0))


def _cpu(batches):
    return [{k: v.cpu() for k, v in b.items()} for b in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("depth", [None, 0, 3])
def test_batches_arrive_on_the_device(corpus, num_workers, depth):
    ldr = loader(dataset(corpus), num_workers=num_workers, device_prefetch=depth)
    assert ldr.pin_memory and ldr.device.type == "cuda"
    assert ldr.device_prefetch == (2 if depth is None else depth)
    batches = take(ldr, 5)
    for batch in batches:
        assert all(v.device == ldr.device for v in batch.values())
    cpu = take(loader(dataset(corpus), num_workers=num_workers, device="cpu"), 5)
    assert_batches_equal(_cpu(batches), cpu)


def test_a_consumer_on_another_stream_reads_complete_batches(corpus):
    """The consumer's current stream waits on the copy's event; record_stream keeps the memory
    from being reused while that stream still reads it."""
    cpu = take(loader(dataset(corpus), device="cpu"))
    stream = torch.cuda.Stream()
    got = []
    with torch.cuda.stream(stream):
        for batch in loader(dataset(corpus), device_prefetch=2):
            torch.cuda._sleep(1_000_000)  # a long kernel on this stream while copies go on
            got.append({k: (v * 1).cpu() for k, v in batch.items()})
    assert_batches_equal(got, cpu)


def test_exact_resume_under_device_prefetch(corpus):
    reference = _cpu(take(loader(dataset(corpus), num_workers=2)))
    first = loader(dataset(corpus), num_workers=2, device_prefetch=3)
    it = iter(first)
    head = [{k: v.cpu() for k, v in next(it).items()} for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))
    del it
    resumed = loader(dataset(corpus), num_workers=2, device_prefetch=3)
    resumed.load_state_dict(state, strict=True)
    assert_batches_equal(head + _cpu(take(resumed)), reference)


def test_default_device_is_the_local_rank(corpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count() - 1))
    assert loader(dataset(corpus)).device == torch.device("cuda", torch.cuda.device_count() - 1)


def test_flex_attention_matches_dense_on_packed_batches(corpus):
    from torch.nn.attention.flex_attention import flex_attention

    from streamforge import document_block_mask, packed_causal_mask

    batch = take(loader(dataset(corpus, seq_len=256), batch_size=2), 1)[0]
    doc_ids = batch["doc_ids"]
    q, k, v = (torch.randn(2, 2, 256, 32, device=doc_ids.device) for _ in range(3))
    flex = flex_attention(q, k, v, block_mask=document_block_mask(doc_ids))
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=packed_causal_mask(doc_ids).unsqueeze(1)
    )
    real = doc_ids >= 0
    torch.testing.assert_close(flex.transpose(1, 2)[real], dense.transpose(1, 2)[real], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_ramp_and_a_warmup_arrive_on_the_device_shape_by_shape(corpus, num_workers):
    """Batch-size and sequence-length schedules change the batches' shapes at their steps;
    copied ahead on the side stream, every batch arrives whole, in its step's shape, equal to
    the CPU run's, and a resume inside the ramp is exact on the device too."""
    ramp, warmup = [(0, 2), (3, 4), (7, 3)], [(0, 64), (5, 128)]

    def make(device=None):
        return loader(dataset(corpus, seq_len=warmup), batch_size=ramp, num_workers=num_workers,
                      **({"device": device} if device else {}))

    ldr = make()
    batches = take(ldr, 10)
    shapes = [tuple(b["input_ids"].shape) for b in batches]
    assert shapes == [(2, 64)] * 3 + [(4, 64)] * 2 + [(4, 128)] * 2 + [(3, 128)] * 3
    assert all(v.device == ldr.device for b in batches for v in b.values())
    assert_batches_equal(_cpu(batches), take(make("cpu"), 10))
    half = make()
    take(half, 4)
    state = half.state_dict()
    resumed = make()
    resumed.load_state_dict(state, strict=True)
    assert_batches_equal(_cpu(take(resumed, 6)), _cpu(batches[4:]))
