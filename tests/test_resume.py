"""Exact resume: cut anywhere, restore into a fresh loader, get the same batches bit for bit."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from helpers.pipeline import assert_batches_equal, dataset, loader, make_corpus, take
from streamforge import unpack_state

CONFIGS = [
    pytest.param(dict(num_workers=0), id="w0"),
    pytest.param(dict(num_workers=1), id="w1"),
    pytest.param(dict(num_workers=2), id="w2"),
    pytest.param(dict(num_workers=4), id="w4"),
    pytest.param(dict(num_workers=0, packing="bestfit"), id="w0-bestfit"),
    pytest.param(dict(num_workers=2, packing="bestfit", boundary="stream"), id="w2-bestfit-stream"),
    pytest.param(dict(num_workers=2, packing="pad"), id="w2-pad"),
    pytest.param(dict(num_workers=0, infinite=True), id="w0-infinite"),
    pytest.param(dict(num_workers=2, infinite=True), id="w2-infinite"),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"), np.random.default_rng(7))


def _build(corpus, cfg):
    cfg = dict(cfg)
    num_workers = cfg.pop("num_workers")
    ds = dataset(corpus, weights=[0.5, 0.3, 0.2], provenance=True, **cfg)
    return loader(ds, num_workers=num_workers)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_exact_resume_at_random_batches(corpus, cfg):
    infinite = cfg.get("infinite", False)
    limit = 600 if infinite else None  # infinite runs cross several passes of the small streams
    reference = take(_build(corpus, cfg), limit)
    assert len(reference) > 20
    rng = np.random.default_rng(len(reference))
    cuts = sorted({0, 1, len(reference) - 1, *rng.integers(2, len(reference) - 1, size=3).tolist()})
    for cut in cuts:
        first = _build(corpus, cfg)
        head = take(first, cut) if cut else []
        state = json.loads(json.dumps(first.state_dict()))  # plain data, through JSON
        assert_batches_equal(head, reference[:cut])
        resumed = _build(corpus, cfg)
        resumed.load_state_dict(state)
        assert resumed.resume_report.mode == "exact", str(resumed.resume_report)
        tail = take(resumed, None if limit is None else limit - cut)
        assert_batches_equal(tail, reference[cut:])


def test_infinite_run_crosses_pass_boundaries(corpus):
    ref = take(_build(corpus, dict(num_workers=0, infinite=True)), 600)
    segments = torch.cat([b["segments"].reshape(-1, 5) for b in ref])
    web_docs = segments[(segments[:, 0] == 0) & (segments[:, 3] == 0)]
    # the same 600 batches the resume test cuts into read "web" (300 records) past one pass
    assert len(web_docs) > len(corpus["web"][1])


def test_state_is_small_and_versioned(corpus):
    ldr = _build(corpus, dict(num_workers=2))
    take(ldr, 7)
    state = ldr.state_dict()
    blob = json.dumps(state)
    assert len(blob) < 16_000
    inner = unpack_state(state)
    assert state["version"] == inner["version"] == 4 and len(inner["fingerprint"]) == 32
    assert len(state["digest"]) == 64
    assert inner["config"]["workers_per_rank"] == 2 and inner["config"]["batch_size"] == 2


def test_state_saved_mid_iteration_ignores_prefetched_batches(corpus):
    ref = take(_build(corpus, dict(num_workers=2)), 30)
    ldr = _build(corpus, dict(num_workers=2, ))
    ldr.prefetch_factor = 4
    it = iter(ldr)
    for _ in range(11):
        next(it)
    state = ldr.state_dict()  # workers have prefetched more than 11 batches by now
    resumed = _build(corpus, dict(num_workers=2))
    resumed.load_state_dict(state)
    assert_batches_equal(take(resumed, 19), ref[11:30])


def test_changed_config_is_never_exact(corpus):
    ldr = _build(corpus, dict(num_workers=2))
    take(ldr, 5)
    state = ldr.state_dict()
    other = loader(dataset(corpus, weights=[0.5, 0.3, 0.2], provenance=True), num_workers=4)
    other.load_state_dict(state)
    report = other.resume_report
    assert report.mode == "elastic"  # only the topology changed: re-planned, not approximated
    assert any("workers_per_rank" in d for d in report.differences)
    assert "tokens left" in " ".join(report.approximations)
    assert len(take(other, 3)) == 3
    seeded = loader(dataset(corpus, weights=[0.5, 0.3, 0.2], provenance=True, seed=1), num_workers=2)
    seeded.load_state_dict(state)
    assert seeded.resume_report.mode == "statistical"
    assert any(d.startswith("seed") for d in seeded.resume_report.differences)
    assert "consumed" in " ".join(seeded.resume_report.approximations)


def test_resume_in_a_new_process(corpus, tmp_path):
    cfg = dict(num_workers=2)
    reference = take(_build(corpus, cfg), 40)
    first = _build(corpus, cfg)
    take(first, 17)
    (tmp_path / "state.json").write_text(json.dumps(first.state_dict()))
    urls = {name: url for name, (url, _) in corpus.items()}
    script = textwrap.dedent(f"""
        import json, sys, torch
        from streamforge import PackedTokenDataset, Stream, StreamingLoader
        urls = {urls!r}
        streams = [Stream(urls[n], weight=w, name=n) for n, w in zip(urls, [0.5, 0.3, 0.2])]
        ds = PackedTokenDataset(streams, seq_len=64, shuffle_buffer=32, shuffle_warmup=4, provenance=True)
        ldr = StreamingLoader(ds, batch_size=2, num_workers=2)
        ldr.load_state_dict(json.load(open({str(tmp_path / "state.json")!r})))
        assert ldr.resume_report.mode == "exact", str(ldr.resume_report)
        out = []
        for batch in ldr:
            out.append(batch)
            if len(out) == 23:
                break
        torch.save(out, {str(tmp_path / "tail.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    tail = torch.load(tmp_path / "tail.pt")
    assert_batches_equal(tail, reference[17:40])
