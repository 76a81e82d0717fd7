"""Hybrid-parallel jobs, with real processes: torchrun of 4 gloo ranks on a DeviceMesh of
("dp", "tp") (2, 2), the loader under it (tests/helpers/workers/mesh_worker.py).

* tensor-parallel peers get identical batches, data-parallel ranks differ, and over the pass
  the data-parallel ranks deliver every token once (within the plan's drop bound), with an
  all-reduce over the data-parallel group after every step;
* ``state_dict()`` is the same on every process, and a DCP checkpoint restarts in new
  processes on the same mesh exactly; on (2, 1), with only the tensor degree changed, too;
* on (4, 1) and (1, 4) the same checkpoint resumes elastically: the rest of the pass, every
  token once, replicas identical;
* Megatron-style (``group=``) gives the mesh's batches; ``read_once=True`` too, while the
  replicas fetch no shard byte; a pipeline stage asking for the labels only keeps the clock;
* every bad configuration is a ``ConfigError`` naming it, raised on every process.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers.pipeline import delivered_tokens, random_docs, write_stream
from helpers.torchrun import torchrun
from streamforge import Manifest

WORKER = Path(__file__).parent / "helpers" / "workers" / "mesh_worker.py"
SAVE_AT, STEPS = 4, 6  # as in the worker


def _torchrun(out: Path, mode: str, dp: int, tp: int, urls: list[str]) -> None:
    torchrun(WORKER, out, mode, dp, tp, *urls, nproc=dp * tp)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The corpus, and the reference run on (2, 2) with its DCP checkpoint after step SAVE_AT."""
    root = tmp_path_factory.mktemp("mesh")
    rng = np.random.default_rng(3)
    urls = []
    for name, n, median in (("web", 120, 40), ("code", 40, 120)):
        urls.append(str(root / name))
        write_stream(urls[-1], random_docs(rng, n, median))
    out = root / "out"
    out.mkdir()
    _torchrun(out, "run", 2, 2, urls)
    return out, urls


def _rows(out: Path, tag: str, processes: int) -> list[list[dict]]:
    """Each process's steps: step, data-parallel rank, batch (and its replica index, apart)."""
    return [[json.loads(line) for line in (out / f"{tag}-p{p}.jsonl").read_text().splitlines()]
            for p in range(processes)]


def _data(rows: list[dict]) -> list[dict]:
    """The rows without the replica index: what replicas must share."""
    return [{k: v for k, v in row.items() if k != "replica"} for row in rows]


def _reports(out: Path, tag: str, processes: int) -> list[dict]:
    return [json.loads((out / f"{tag}-p{p}.json").read_text()) for p in range(processes)]


def _by_dp(rows: list[list[dict]]) -> dict[int, list[dict]]:
    """Replica 0's rows of each data-parallel rank."""
    return {r[0]["dp"]: r for r in rows if r and r[0]["replica"] == 0}


def _total_tokens(urls: list[str]) -> int:
    manifests = [Manifest.load(u) for u in urls]
    return sum(m.num_tokens + int(m.columns["num_docs"].sum()) for m in manifests)  # EOS appended


def _delivered(pieces: list[list[int]]) -> int:
    """Tokens the pieces hold, asserting that none is delivered twice."""
    return delivered_tokens(pieces)


def test_replicas_share_batches_and_the_dp_ranks_cover_the_pass_once(job):
    out, urls = job
    rows, reports = _rows(out, "run-2x2", 4), _reports(out, "run-2x2", 4)
    assert [(r["dp"], r["replica"]) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # tp is the fast dim
    assert _data(rows[0]) == _data(rows[1]) and _data(rows[2]) == _data(rows[3])  # tensor-parallel peers
    assert [r["input_ids"] for r in rows[0]] != [r["input_ids"] for r in rows[2]]
    assert len({r["digest"] for r in reports}) == 1  # one state for the whole job, on every process
    assert len({r["step"] for r in reports}) == 1 and reports[0]["step"] == len(rows[0])
    pieces = [p for dp_rows in _by_dp(rows).values() for row in dp_rows for p in row["pieces"]]
    total = _total_tokens(urls)
    assert 0 <= total - _delivered(pieces) <= reports[0]["drop_bound"]
    # the ledger: written once per data-parallel rank (replica 0), every token of the pass once
    from streamforge import read_ledger
    from streamforge.ledger.report import check

    assert sorted(p.name for p in (out / "ledger").glob("rank*")) == ["rank00000", "rank00001"]
    report = check(read_ledger(str(out / "ledger")))
    assert report["ok"] and report["passes"][0]["delivered_tokens"] == _delivered(pieces)


@pytest.mark.parametrize("dp,tp", [(2, 2), (2, 1)])
def test_a_dcp_checkpoint_restarts_exactly_on_the_same_data_parallel_degree(job, dp, tp):
    out, urls = job
    _torchrun(out, "resume", dp, tp, urls)
    want, got = _by_dp(_rows(out, "run-2x2", 4)), _by_dp(_rows(out, f"resume-{dp}x{tp}", dp * tp))
    for rank in range(dp):
        assert got[rank] == [row for row in want[rank] if row["step"] >= SAVE_AT]
    reports = _reports(out, f"resume-{dp}x{tp}", dp * tp)
    assert {r["resume"] for r in reports} == {"exact"}
    if tp > 1:
        rows = _rows(out, f"resume-{dp}x{tp}", dp * tp)
        assert _data(rows[0]) == _data(rows[1]) and _data(rows[2]) == _data(rows[3])


@pytest.mark.parametrize("dp,tp", [(4, 1), (1, 4)])
def test_a_dcp_checkpoint_resumes_elastically_on_another_data_parallel_degree(job, dp, tp):
    out, urls = job
    _torchrun(out, "resume", dp, tp, urls)
    rows, reports = _rows(out, f"resume-{dp}x{tp}", 4), _reports(out, f"resume-{dp}x{tp}", 4)
    assert {r["resume"] for r in reports} == {"elastic"} and {r["dp_size"] for r in reports} == {dp}
    assert len({r["digest"] for r in reports}) == 1 and len({r["step"] for r in reports}) == 1
    if tp > 1:
        assert all(_data(r) == _data(rows[0]) for r in rows)  # the new replicas: identical batches
    before = _by_dp(_rows(out, "run-2x2", 4))
    pieces = [p for dp_rows in before.values() for row in dp_rows if row["step"] < SAVE_AT for p in row["pieces"]]
    pieces += [p for dp_rows in _by_dp(rows).values() for row in dp_rows for p in row["pieces"]]
    saved_bound = _reports(out, "run-2x2", 4)[0]["drop_bound"]
    assert 0 <= _total_tokens(urls) - _delivered(pieces) <= saved_bound + reports[0]["drop_bound"]


@pytest.fixture(scope="module")
def variants(job):
    out, urls = job
    _torchrun(out, "variants", 2, 2, urls)
    return out


def test_megatron_style_group_gives_the_meshs_batches(job, variants):
    want, got = _rows(variants, "run-2x2", 4), _rows(variants, "megatron", 4)  # same processes, same places
    for process in range(4):
        assert got[process] == want[process][:STEPS]


def test_read_once_gives_the_same_batches_and_state_with_one_reader_per_replica_group(job, variants):
    want, got = _rows(variants, "run-2x2", 4), _rows(variants, "read_once", 4)
    reports = _reports(variants, "read_once", 4)
    for process in range(4):
        stage = reports[process]["replica"] == 1  # asked for the labels only
        for w, g in zip(want[process][:STEPS], got[process], strict=True):
            assert g == ({**w, "input_ids": None} if stage else w)
    assert len({r["digest"] for r in reports}) == 1
    readers = [r for r in reports if r["replica"] == 0]
    replicas = [r for r in reports if r["replica"] == 1]
    assert all(r["reads_storage"] and r["bytes_fetched"] > 0 for r in readers)
    assert all(not r["reads_storage"] and r["bytes_fetched"] == 0 for r in replicas)
    # what a replica still reads: the record indexes of the plan's cut shards, a few hundred bytes
    assert all(r["index_bytes"] < 0.05 * readers[0]["bytes_fetched"] for r in replicas)


def test_bad_configurations_are_named_on_every_process(variants):
    errors = [json.loads((variants / f"errors-p{p}.json").read_text()) for p in range(4)]
    want = {
        "no_dp_dim": "have no data-parallel one",
        "unknown_dim": "['data'] not in the mesh's dimensions ['dp', 'tp']",
        "tp_as_dp": "mesh dimension 'tp' is not data-parallel",
        "mesh_and_rank": "do not pass rank, world_size too",
        "group_size": "world_size=4 disagrees with group= of 2 ranks",
        "replicas_differ": "differ in read_once: [True, False]",
    }
    for got in errors:
        for case, text in want.items():
            assert text in got[case], (case, got[case])


def test_a_topology_reaches_worker_processes_without_its_groups():
    import pickle

    from streamforge.errors import ConfigError
    from streamforge.topology import Groups, Topology

    topology = Topology(1, 2, 1, 2, Groups(object(), (1, 3), object(), (2, 3)))
    sent = pickle.loads(pickle.dumps(topology))
    assert sent == topology and sent.groups is None and (sent.replica, sent.replicas) == (1, 2)
    with pytest.raises(ConfigError, match="dp_dims= names dimensions of a mesh"):
        Topology.build(dp_dims=("dp",))
    with pytest.raises(ConfigError, match="group= needs torch.distributed"):
        Topology.build(group=object())
