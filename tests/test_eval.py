"""Evaluation passes: the same rows on every topology, every held-out token once, equal
batch counts per rank, and the same summed loss on one process and under torchrun."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.pipeline import EOS, random_docs, take, write_stream
from helpers.s3_server import free_port
from streamforge import ConfigError, Manifest, PackedTokenDataset, Stream, StreamingLoader, StreamLoss
from streamforge.pipeline.evaluation import deal_rows

ROOT = Path(__file__).parent.parent
SEQ = 64
KEYS = ("input_ids", "labels", "position_ids", "doc_ids", "source_ids")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two streams of very different sizes; one empty record."""
    root = tmp_path_factory.mktemp("eval")
    rng = np.random.default_rng(7)
    big = random_docs(rng, 260, 60)
    small = random_docs(rng, 9, 300)
    small.insert(3, np.zeros(0, np.uint16))
    out = {}
    for name, docs in (("big", big), ("small", small)):
        url = str(root / name)
        out[name] = (url, write_stream(url, docs))
    return out


def _dataset(corpus, rank=0, world=1, weights=(0.9, 0.1), **kwargs):
    streams = [Stream(url, weight=w, name=n) for (n, (url, _)), w in zip(corpus.items(), weights)]
    kwargs.setdefault("seq_len", SEQ)
    return PackedTokenDataset(streams, evaluation=True, rank=rank, world_size=world, **kwargs)


def _job(corpus, world, workers, batch, **kwargs):
    """Every rank's batches; checks each rank has ``steps_per_pass`` full batches."""
    ranks = []
    for r in range(world):
        loader = StreamingLoader(_dataset(corpus, r, world, **kwargs), batch_size=batch, num_workers=workers)
        batches = take(loader)
        assert len(batches) == loader.steps_per_pass
        for b in batches:
            assert b["input_ids"].shape == (batch, SEQ)
        ranks.append(batches)
    assert len({len(b) for b in ranks}) == 1
    return ranks


def _rows(ranks) -> collections.Counter:
    out = collections.Counter()
    for batches in ranks:
        for b in batches:
            for i in range(b["input_ids"].shape[0]):
                if (b["doc_ids"][i] >= 0).any():
                    out[tuple(torch.cat([b[k][i].long() for k in KEYS]).tolist())] += 1
                else:  # a padding row counts for nothing
                    assert (b["labels"][i] == -100).all() and (b["source_ids"][i] == -1).all()
    return out


@pytest.mark.parametrize("packing", ["concat", "pad"])
def test_rows_are_the_same_on_every_topology(corpus, packing):
    want = _rows(_job(corpus, 1, 0, 4, packing=packing))
    for world, workers, batch in [(2, 2, 3), (3, 1, 5), (1, 2, 7), (2, 0, 1)]:
        got = _rows(_job(corpus, world, workers, batch, packing=packing))
        assert got == want, f"R={world} W={workers} B={batch}"


@pytest.mark.parametrize("packing", ["concat", "pad"])
def test_every_held_out_token_once(corpus, packing):
    ranks = _job(corpus, 2, 2, 3, packing=packing, provenance=True)
    names = list(corpus)
    firsts = [Manifest.load(url).first_records for url, _ in corpus.values()]
    got: dict[tuple[int, int], dict[int, int]] = collections.defaultdict(dict)
    for batches in ranks:
        for b in batches:
            for row in range(b["input_ids"].shape[0]):
                col = 0
                for stream, shard, record, start, length in b["segments"][row].tolist():
                    if stream < 0:
                        continue
                    key = (stream, int(firsts[stream][shard]) + record)
                    for k in range(length):
                        assert start + k not in got[key], f"token {start + k} of {key} delivered twice"
                        got[key][start + k] = int(b["input_ids"][row, col + k])
                    col += length
    for s, name in enumerate(names):
        for i, doc in enumerate(corpus[name][1]):
            want = list(doc) + [EOS] if len(doc) else []
            seen = got.get((s, i), {})
            assert [seen.get(k) for k in range(len(want))] == want and len(seen) == len(want), (name, i)


def test_eval_tokens_gives_the_first_rows_on_any_topology(corpus):
    full = _job(corpus, 1, 0, 4)[0]
    budget = 5 * SEQ + 10
    want = _rows(_job(corpus, 1, 0, 4, eval_tokens=budget))
    assert sum(want.values()) == 6  # rounded up to whole rows
    first = _rows([full])
    assert not want - first  # a prefix of the full pass's rows
    for world, workers, batch in [(2, 1, 2), (3, 0, 1)]:
        assert _rows(_job(corpus, world, workers, batch, eval_tokens=budget)) == want
    tokens = sum(int((b["doc_ids"] >= 0).sum()) for b in _job(corpus, 1, 0, 4, eval_tokens=budget)[0])
    assert budget <= tokens < budget + SEQ


def test_padding_rows_finish_every_rank(corpus):
    loader = StreamingLoader(_dataset(corpus, 2, 3), batch_size=16, num_workers=0)
    batches = take(loader)
    assert len(batches) == loader.steps_per_pass
    last = batches[-1]
    pad = (last["doc_ids"] < 0).all(dim=1)
    assert pad.any()  # this rank ran out of rows in its last batch
    assert (last["labels"][pad] == -100).all() and (last["source_ids"][pad] == -1).all()
    assert loader.stats()["padded_rows"] > 0


def test_iterating_again_replays_and_there_is_no_state(corpus):
    loader = StreamingLoader(_dataset(corpus), batch_size=3, num_workers=0)
    first, second = take(loader), take(loader)
    assert len(first) == len(second) == loader.steps_per_pass
    for a, b in zip(first, second):
        assert all(torch.equal(a[k], b[k]) for k in KEYS)
    half = take(loader, 2)  # a partial iteration does not move the next one
    assert all(torch.equal(a[k], b[k]) for a, b in zip(half, first) for k in KEYS)
    assert len(take(loader)) == len(first)
    with pytest.raises(ConfigError, match="replays the same batches"):
        loader.state_dict()
    with pytest.raises(ConfigError, match="replays the same batches"):
        loader.load_state_dict({})


def test_bad_evaluation_configs_are_refused(corpus):
    with pytest.raises(ConfigError, match="bestfit"):
        _dataset(corpus, packing="bestfit")
    with pytest.raises(ConfigError, match="infinite"):
        _dataset(corpus, infinite=True)
    with pytest.raises(ConfigError, match="eval_tokens must be >= 1"):
        _dataset(corpus, eval_tokens=0)
    with pytest.raises(ConfigError, match="evaluation=True"):
        PackedTokenDataset(corpus["big"][0], seq_len=SEQ, eval_tokens=100)
    with pytest.raises(ConfigError, match="skip_steps"):
        StreamingLoader(_dataset(corpus), batch_size=2, skip_steps=[(0, 1)])


def test_evaluation_from_s3_equals_local(corpus, s3_bucket):
    bucket, options = s3_bucket
    streams = []
    for name, (_, docs) in corpus.items():
        url = f"s3://{bucket}/{name}"
        write_stream(url, docs, storage_options=options)
        streams.append(Stream(url, name=name, storage_options=options))
    remote = StreamingLoader(PackedTokenDataset(streams, seq_len=SEQ, evaluation=True), batch_size=4, num_workers=2)
    local = StreamingLoader(_dataset(corpus), batch_size=4, num_workers=2)
    got, want = take(remote), take(local)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        for k in KEYS:
            assert torch.equal(a[k], b[k]), (i, k)


def test_stream_loss_equals_a_direct_computation(corpus):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 1000)).double()
    train = PackedTokenDataset([Stream(u, name=n) for n, (u, _) in corpus.items()], seq_len=SEQ, shuffle_buffer=16)
    metric = StreamLoss(train.stream_names)
    sums, counts = np.zeros(2), np.zeros(2)
    with torch.no_grad():
        for batch in StreamingLoader(train, batch_size=2):
            per_token = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(),
                                        reduction="none")
            metric.update(per_token, batch)
            for i in range(batch["labels"].numel()):
                label, s = int(batch["labels"].flatten()[i]), int(batch["source_ids"].flatten()[i])
                if label != -100:
                    sums[s] += float(per_token[i])
                    counts[s] += 1
    got = metric.compute()
    assert got["big"] == pytest.approx(sums[0] / counts[0], rel=1e-12)
    assert got["small"] == pytest.approx(sums[1] / counts[1], rel=1e-12)
    assert got["all"] == pytest.approx(sums.sum() / counts.sum(), rel=1e-12)
    metric.reset()
    assert np.isnan(metric.compute()["all"])


def _run_eval(tmp_path, corpus, *, torchrun: bool, packing="concat", batch=3, workers=1) -> dict:
    out = tmp_path / ("ddp" if torchrun else "one")
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    script = [str(Path(__file__).parent / "helpers" / "workers" / "eval_worker.py"), str(out), packing, str(batch), str(workers),
              *[url for url, _ in corpus.values()]]
    launch = ["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
              f"--master_port={free_port()}"] if torchrun else []
    proc = subprocess.run([sys.executable, *launch, *script], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


def test_torchrun_evaluation_equals_one_process(corpus, tmp_path):
    one = _run_eval(tmp_path, corpus, torchrun=False, batch=4, workers=0)
    ddp = _run_eval(tmp_path, corpus, torchrun=True, batch=3, workers=1)
    assert ddp["counts"] == one["counts"]  # every held-out label once, on either topology
    np.testing.assert_allclose(ddp["sums"], one["sums"], rtol=1e-10)
    for result in (one, ddp):
        np.testing.assert_allclose(result["by_hand"][0], result["sums"], rtol=1e-10)
        assert result["by_hand"][1] == result["counts"]
        assert len({tuple(s) for s in result["steps"]}) == 1  # every rank: steps_per_pass batches
        assert result["steps"][0][0] == result["steps"][0][1]
    assert ddp["means"]["all"] == pytest.approx(one["means"]["all"], rel=1e-10)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 500), world=st.integers(1, 6), workers=st.integers(1, 4), batch=st.integers(1, 9))
def test_deal_rows_covers_each_row_once_within_capacity(rows, world, workers, batch):
    steps, runs = deal_rows(rows, world_size=world, workers_per_rank=workers, batch_size=batch)
    assert steps == -(-rows // (world * batch))
    assert runs[0][0] == 0 and runs[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))  # contiguous, in order
    for g, (a, b) in enumerate(runs):
        w = g % workers
        batches = -(-(steps - w) // workers) if steps > w else 0
        assert 0 <= b - a <= batches * batch
    sizes = [b - a for a, b in runs]
    assert max(sizes) - min(sizes) <= batch  # balanced up to the capacities' own spread


def test_direct_iteration_of_an_evaluation_dataset_resumes_by_cursor(corpus):
    from streamforge.pipeline.blocks import BlockIterator

    ds = _dataset(corpus)
    whole = list(BlockIterator(ds))
    it = BlockIterator(ds)
    head = [next(it) for _ in range(7)]
    state = json.loads(json.dumps(it.state_dict()))
    again = BlockIterator(ds)
    again.load_state_dict(state)
    for a, b in zip(head + list(again), whole):
        assert all(torch.equal(a[k], b[k]) for k in KEYS)
    assert len(head) + len(list(BlockIterator(ds))) - 7 == len(whole)
