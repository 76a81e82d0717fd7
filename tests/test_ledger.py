"""The data-order ledger on real loaders: clean runs, resumes after a kill, tampering, diff, show."""

import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.pipeline import dataset, loader, make_corpus, take, write_stream, random_docs
from streamforge.pipeline.batch import RowBatch
from streamforge.cli import main
from streamforge.ledger.store import LedgerWriter, read_ledger
from streamforge.ledger.report import check, diff, find_overlaps, show

WEIGHTS = [0.5, 0.3, 0.2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"), np.random.default_rng(11))


def _loader(corpus, ledger_dir, num_workers=0, seed=0, **kwargs):
    ds = dataset(corpus, weights=WEIGHTS, provenance=True, seed=seed)
    return loader(ds, num_workers=num_workers, ledger_dir=None if ledger_dir is None else str(ledger_dir), **kwargs)


def _cli(capsys, *argv):
    code = main(["ledger", *map(str, argv)])
    return code, capsys.readouterr().out


def _segments(batch):
    """(stream, shard, record, token_start, length) of every row piece of a batch, row-major."""
    seg = batch["segments"].numpy()
    return [tuple(s) for row in seg for s in row.tolist() if s[0] >= 0]


def _shown(report):
    out = []
    for rank in report["ranks"]:
        for p in rank["rows"]:
            out.append((p["stream"], p["shard"], p["record"], p["tokens"][0], p["tokens"][1] - p["tokens"][0]))
    return out


# -- one run -----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_whole_pass_checks_clean_and_covers_every_record(corpus, tmp_path, num_workers):
    ldr = _loader(corpus, tmp_path / "ledger", num_workers=num_workers)
    batches = take(ldr)
    ledger = read_ledger(str(tmp_path / "ledger"))
    assert sorted(set(ledger.steps["step"].tolist())) == list(range(len(batches)))
    report = check(ledger, {n: m for n, m in zip(ldr.dataset.stream_names, ldr.dataset.manifests)})
    assert report["ok"], report["problems"]
    (p,) = report["passes"]
    assert p["complete"] and p["delivered_tokens"] == sum(int((b["doc_ids"] >= 0).sum()) for b in batches)
    assert p["not_delivered_tokens"] == p["dropped_tokens"] <= p["drop_bound"]
    for name, counts in p["records_never_reached"].items():
        assert counts["never_reached"] == 0, name  # a whole pass reaches every non-empty record
    names = ldr.dataset.stream_names
    for step in range(len(batches)):  # the ledger holds what each batch held
        want = [(names[s], sh, r, t, n) for s, sh, r, t, n in _segments(batches[step])]
        assert _shown(show(ledger, step)) == want


def test_chunks_are_written_every_chunk_steps_and_at_state_dict(corpus, tmp_path):
    ldr = _loader(corpus, tmp_path / "ledger")
    ldr.ledger.chunk_steps = 10
    take(ldr, 25)
    ldr.ledger._drain()  # the two full chunks were handed to the background writer
    names = sorted(p.name for p in (tmp_path / "ledger" / "rank00000").iterdir())
    assert names == ["gen-000000-000000.npz", "gen-000000-000001.npz"]
    assert (tmp_path / "ledger" / "generations" / "gen-000000" / "rank00000.json").exists()
    ldr.state_dict()  # a checkpoint: the 5 buffered steps reach storage before it returns
    assert read_ledger(str(tmp_path / "ledger")).steps["step"].tolist() == list(range(25))


# -- restarts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("flushed", [True, False], ids=["tail-flushed", "tail-lost"])
def test_resume_after_a_kill_past_the_checkpoint_checks_clean(corpus, tmp_path, num_workers, flushed):
    url = tmp_path / "ledger"
    reference = take(_loader(corpus, None, num_workers=num_workers))
    first = _loader(corpus, url, num_workers=num_workers)
    take(first, 12)
    state = json.loads(json.dumps(first.state_dict()))  # the checkpoint at step 12
    it = iter(first)
    for _ in range(9):  # the job trains on past the checkpoint, then is killed
        next(it)
    if flushed:
        first.ledger.flush()
    else:
        first.ledger._steps.clear()
        first.ledger._pieces.clear()
    first.ledger.close()
    resumed = _loader(corpus, url, num_workers=num_workers)
    resumed.load_state_dict(state)
    tail = take(resumed)
    assert len(tail) + 12 == len(reference)
    ledger = read_ledger(str(url))
    assert [r["resumed_at_step"] for r in ledger.restarts] == [0, 12]
    assert ledger.steps["step"].tolist() == list(range(len(reference)))
    assert len(ledger.rolled_back["step"]) == (9 if flushed else 0)
    report = check(ledger)
    assert report["ok"], report["problems"]
    assert report["passes"][0]["complete"]
    assert report["passes"][0]["not_delivered_tokens"] == report["passes"][0]["dropped_tokens"]
    # the resumed run's data order is the uninterrupted run's
    clean = tmp_path / "clean"
    take(_loader(corpus, clean, num_workers=num_workers))
    assert diff(ledger, read_ledger(str(clean)))["identical"]


def test_infinite_runs_check_their_steps(corpus, tmp_path):
    url = tmp_path / "ledger"
    ds = dataset(corpus, weights=WEIGHTS, infinite=True)
    first = loader(ds, ledger_dir=str(url))
    take(first, 40)
    state = first.state_dict()
    take(first, 10)
    first.ledger.close()
    resumed = loader(dataset(corpus, weights=WEIGHTS, infinite=True), ledger_dir=str(url))
    resumed.load_state_dict(state)
    take(resumed, 700)  # past a pass of the small streams: records come back, as they should
    resumed.state_dict()  # a checkpoint: everything so far is on storage
    report = check(read_ledger(str(url)))
    assert report["ok"], report["problems"]
    assert report["exactly_once"].startswith("not checked") and report["ledger"]["steps"] == [0, 739]


def test_rollback_is_by_step_over_the_whole_job_across_world_sizes(tmp_path):
    """Generation 1 of 2 ranks resumes at step 5 a job of 4 ranks: steps >= 5 of ranks 2
    and 3 are void too, though no rank of the restart writes in their directories."""
    url = str(tmp_path / "ledger")

    def rows(rank, step):
        one = np.ones(1, np.int64)
        return RowBatch(np.zeros((1, 9), np.uint16), np.zeros(1, bool), 0 * one, 8 * one, np.zeros(1, np.int16),
                        np.array([rank], np.int32), np.array([step], np.int64), 0 * one, np.zeros(1, bool))

    meta = {"streams": [{"name": "s", "manifest": "x"}], "seq_len": 8, "batch_size": 1}
    for rank in range(4):
        w = LedgerWriter(url, rank=rank, world_size=4, meta=meta)
        for step in range(8):
            w.add(step, 0, rows(rank, step))
        w.close()
    for rank in range(2):  # one after the other: rank 1 sees rank 0's restart (no process group)
        w = LedgerWriter(url, rank=rank, world_size=2, meta=meta)
        w.start_generation(5, "statistical")
        for step in range(5, 10):
            w.add(step, 0, rows(rank + 10, step))
        w.close()
    ledger = read_ledger(url)
    assert [(r["resumed_at_step"], r["ranks"]) for r in ledger.restarts] == [(0, [0, 1, 2, 3]), (5, [0, 1])]
    kept = sorted(zip(ledger.steps["step"].tolist(), ledger.steps["rank"].tolist()))
    assert kept == sorted([(s, r) for s in range(5) for r in range(4)] + [(s, r) for s in range(5, 10) for r in range(2)])
    assert len(ledger.rolled_back["step"]) == 12
    assert check(ledger)["ok"]


def test_two_ranks_resumed_exactly_check_clean(corpus, tmp_path):
    url = tmp_path / "ledger"
    states = []
    for rank in range(2):
        ldr = loader(dataset(corpus, weights=WEIGHTS, rank=rank, world_size=2), ledger_dir=str(url))
        take(ldr, 10)
        states.append(ldr.state_dict())
        take(ldr, 5)
        ldr.ledger.close()
    for rank in range(2):
        ldr = loader(dataset(corpus, weights=WEIGHTS, rank=rank, world_size=2), ledger_dir=str(url))
        ldr.load_state_dict(states[rank])
        take(ldr)
    report = check(read_ledger(str(url)))
    assert report["ok"], report["problems"]
    assert report["passes"][0]["complete"] and report["ledger"]["rolled_back_rank_steps"] == 10


def test_a_statistical_resume_shows_what_it_delivered_again(corpus, tmp_path):
    url = tmp_path / "ledger"
    first = _loader(corpus, url)
    take(first, 100)
    state = first.state_dict()
    resumed = _loader(corpus, url, num_workers=2)  # another topology, positions estimated on request
    resumed.load_state_dict(state, mode="statistical")
    assert resumed.resume_report.mode == "statistical"
    take(resumed)
    report = check(read_ledger(str(url)))
    assert [r["mode"] for r in report["ledger"]["restarts"]] == ["fresh", "statistical"]
    if report["duplicates"]:  # the estimate re-delivers a little; each case says when
        assert not report["ok"] and "after a statistical resume" in report["problems"][-1]
        assert all(d["first"]["generation"] == 0 and d["again"]["generation"] == 1 and d["again"]["step"] >= 100
                   for d in report["duplicates"])


def test_torchrun_ranks_agree_on_generations(corpus, tmp_path):
    """Two gloo ranks: one all-reduce per generation gives both the same number."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers.s3_server import free_port

    urls = [url for url, _ in corpus.values()]
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(here / "helpers" / "workers" / "ledger_dist_worker.py"), str(tmp_path / "ledger"), *urls]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ledger = read_ledger(str(tmp_path / "ledger"))
    assert [(r["generations"], r["ranks"], r["resumed_at_step"]) for r in ledger.restarts] == [
        ([0], [0, 1], 0), ([1], [0, 1], 10)]
    report = check(ledger)
    assert report["ok"], report["problems"]
    assert report["passes"][0]["complete"] and report["ledger"]["rolled_back_rank_steps"] == 5


# -- what check catches ------------------------------------------------------------------------
@pytest.fixture
def finished(corpus, tmp_path):
    url = tmp_path / "ledger"
    ldr = _loader(corpus, url)
    ldr.ledger.chunk_steps = 50
    take(ldr, 120)
    ldr.state_dict()
    return url


def test_a_chunk_copied_under_another_generation_is_caught(finished, capsys):
    rank = finished / "rank00000"
    header = json.loads((finished / "generations" / "gen-000000" / "rank00000.json").read_text())
    header.update(generation=1, resumed_at_step=100)
    (finished / "generations" / "gen-000001").mkdir()
    (finished / "generations" / "gen-000001" / "rank00000.json").write_text(json.dumps(header))
    shutil.copy(rank / "gen-000000-000001.npz", rank / "gen-000001-000000.npz")  # steps 50..99 again
    code, out = _cli(capsys, "check", finished, "--no-manifests")
    assert code == 1
    assert "FAILED" in out and "delivered twice" in out
    assert "generation 1 resumed at step 100 but recorded steps 50..99" in out
    report = check(read_ledger(str(finished)))
    assert {(d["first"]["step"], d["again"]["generation"]) for d in report["duplicates"]} >= {(50, 1), (99, 1)}


def test_steps_replayed_without_a_generation_are_caught(finished, capsys):
    rank = finished / "rank00000"
    shutil.copy(rank / "gen-000000-000000.npz", rank / "gen-000000-000009.npz")
    code, out = _cli(capsys, "check", finished, "--json", "--no-manifests")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    assert any("steps 0..49 of rank 0 are recorded more than once" in p for p in report["problems"])
    dup = report["duplicates"][0]
    assert dup["first"]["step"] == dup["again"]["step"] and dup["first"]["rank"] == dup["again"]["rank"] == 0


def test_a_lost_chunk_is_a_hole(finished, capsys):
    (finished / "rank00000" / "gen-000000-000001.npz").unlink()
    code, out = _cli(capsys, "check", finished, "--no-manifests")
    assert code == 1 and "50 step(s) not recorded (first 50, last 99)" in out


# -- skipped steps -----------------------------------------------------------------------------
def test_skip_steps_are_recorded_as_skipped(corpus, tmp_path, capsys):
    url = tmp_path / "ledger"
    ldr = _loader(corpus, url, skip_steps=[(10, 13)])
    take(ldr)
    report = check(read_ledger(str(url)))
    assert report["ok"]
    assert report["skipped_steps"] == [{"steps": [10, 13], "tokens": ldr.stats()["skipped_tokens"]}]
    assert report["passes"][0]["skipped_tokens"] == ldr.stats()["skipped_tokens"] > 0
    code, out = _cli(capsys, "show", url, "--step", 11)
    assert code == 0 and "skipped (skip_steps), not trained on" in out
    code, out = _cli(capsys, "check", url)
    assert code == 0 and "steps 10..12" in out


def test_damaged_records_are_listed_and_never_reached(tmp_path, rng):
    from streamforge import PackedTokenDataset, Stream, StreamingLoader
    from streamforge.source import ShardSource
    from streamforge.storage.config import StorageConfig
    from streamforge.storage.open import open_url

    url = str(tmp_path / "web")
    write_stream(url, random_docs(rng, 200, 60))
    source = ShardSource.open(url)
    manifest, index = source.manifest, source.index(1)
    at = int(index.frames["comp_offset"][1]) + int(index.frames["comp_size"][1]) // 2
    fs, path = open_url(url)
    target = f"{path}/{manifest.shard_names[1]}"
    blob = bytearray(fs.cat_file(target))
    blob[at] ^= 0x40  # one flipped byte: frame 1 of shard 1 no longer decodes
    fs.pipe(target, bytes(blob))
    ds = PackedTokenDataset([Stream(url, name="web")], seq_len=64, shuffle_buffer=16,
                            storage=StorageConfig(on_error="skip"))
    take(StreamingLoader(ds, batch_size=2, ledger_dir=str(tmp_path / "ledger")))
    report = check(read_ledger(str(tmp_path / "ledger")), {"web": manifest})
    assert report["ok"], report["problems"]
    lo, hi = int(index.frames["first_record"][1]), index.record_stop(1)
    [entry] = report["damaged"]
    assert (entry["stream"], entry["shard"], entry["start"], entry["stop"]) == ("web", manifest.shard_names[1], lo, hi)
    assert report["passes"][0]["records_never_reached"]["web"]["never_reached"] == hi - lo


# -- diff and show -----------------------------------------------------------------------------
def test_diff_finds_the_first_divergence(corpus, tmp_path, capsys):
    runs = {}
    for name, kwargs in (("a", {}), ("again", {}), ("seed1", {"seed": 1}), ("skip", {"skip_steps": [(7, 9)]})):
        take(_loader(corpus, tmp_path / name, **kwargs), 40)
        runs[name] = tmp_path / name
    code, out = _cli(capsys, "diff", runs["a"], runs["again"])
    assert code == 0 and out.strip() == "identical over 40 steps"
    code, out = _cli(capsys, "diff", runs["a"], runs["seed1"])
    assert code == 1 and out.startswith("first difference: step 0, rank 0")
    code, out = _cli(capsys, "diff", runs["a"], runs["skip"], "--json")
    report = json.loads(out)
    assert code == 1 and (report["step"], report["rank"], report["piece"]) == (7, 0, 0)


def test_show_prints_a_step(corpus, tmp_path, capsys):
    url = tmp_path / "ledger"
    batches = take(_loader(corpus, url), 30)
    code, out = _cli(capsys, "show", url, "--step", 17)
    assert code == 0 and out.startswith("step 17 (pass 0, generation 0)")
    assert "row 0" in out and "row 1" in out
    code, out = _cli(capsys, "show", url, "--step", 17, "--json")
    names = list(corpus)
    want = [(names[s], sh, r, t, n) for s, sh, r, t, n in _segments(batches[17])]
    assert _shown(json.loads(out)) == want
    code, out = _cli(capsys, "show", url, "--step", 999)
    assert code == 1 and "not in the ledger" in out


# -- object storage ----------------------------------------------------------------------------
def test_ledger_on_s3(s3_bucket, capsys, rng):
    bucket, opts = s3_bucket
    stream = f"s3://{bucket}/web"
    write_stream(stream, random_docs(rng, 60, 50), storage_options=opts)
    from streamforge import PackedTokenDataset, Stream, StreamingLoader

    ds = PackedTokenDataset([Stream(stream, name="web", storage_options=opts)], seq_len=32, shuffle_buffer=8)
    ldr = StreamingLoader(ds, batch_size=2, ledger_dir=f"s3://{bucket}/ledger", ledger_options=opts)
    n = len(take(ldr))
    args = ["--endpoint-url", opts["client_kwargs"]["endpoint_url"], "--storage-option", "key=testing",
            "--storage-option", "secret=testing"]
    code, out = _cli(capsys, "check", f"s3://{bucket}/ledger", *args)
    assert code == 0, out
    assert "OK: no token was delivered twice" in out and "web: 0 of 60" in out
    code, out = _cli(capsys, "show", f"s3://{bucket}/ledger", "--step", n - 1, *args)
    assert code == 0 and f"step {n - 1}" in out


# -- the interval checker ----------------------------------------------------------------------
intervals = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 12)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(intervals)
def test_find_overlaps_matches_brute_force(items):
    key = np.array([k for k, _, _ in items], np.int64)
    start = np.array([s for _, s, _ in items], np.int64)
    end = start + np.array([n for _, _, n in items], np.int64)
    later, earlier = find_overlaps([key], start, end)

    def meets(i, j):
        return key[i] == key[j] and max(start[i], start[j]) < min(end[i], end[j])

    overlapping = {i for i in range(len(items)) for j in range(len(items)) if i != j and meets(i, j)}
    found = set(later.tolist()) | set(earlier.tolist())
    assert found == overlapping
    for i, j in zip(later.tolist(), earlier.tolist()):
        assert i != j and meets(i, j)
    assert len(set(later.tolist())) == len(later)


def test_an_elastic_resume_reports_what_its_re_plan_drops(corpus, tmp_path):
    """The re-plan of an elastic resume takes every token the saved job had not handed out,
    its workers' surplus included: the pass drops what the re-plan drops, and the ledger says
    so (it used to report the first plan's figure, 104 tokens, against 1,256 not delivered)."""
    url = tmp_path / "ledger"
    first = _loader(corpus, url)
    take(first, 30)
    state = first.state_dict()
    first.ledger.close()
    resumed = _loader(corpus, url, num_workers=2)
    resumed.load_state_dict(state)
    assert resumed.resume_report.mode == "elastic"
    take(resumed)
    report = check(read_ledger(str(url)))
    assert report["ok"], report["problems"]
    p = report["passes"][0]
    assert p["not_delivered_tokens"] == p["dropped_tokens"] == resumed.stats()["dropped_tokens"] <= p["drop_bound"]
