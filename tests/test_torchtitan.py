"""torchtitan, for real: ``StreamforgeDataLoader`` built from its ``Config`` as torchtitan's
trainer builds it, checkpointed by torchtitan's own ``CheckpointManager`` (DCP) in torchrun
jobs of gloo processes (tests/helpers/workers/torchtitan_worker.py: the trainer's loop with a
tiny model, torchtitan's optimizer and LR scheduler containers; the ``Trainer`` itself needs
CUDA).

* on 2 processes (DP 2) and on 4 (DP 2 x 2 replicas, the loader told only dp_rank and
  dp_world_size, as torchtitan tells it): a restart from the step-4 checkpoint trains the
  uninterrupted run's batches, with its losses, bit for bit; replicas get the same batches
  and every process holds the same state;
* the DP 2 checkpoint resumes on DP 4 elastically: to the end of the pass, the data-order
  ledger over both runs shows no token twice and the whole pass delivered;
* the config-registry function of docs/integrations-torchtitan.md parses through torchtitan's
  ``ConfigManager`` (with a CLI override) and its loader yields torchtitan's batch format.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers.pipeline import random_docs, write_stream
from helpers.torchrun import torchrun

pytest.importorskip("torchtitan", reason="the torchtitan tests need torchtitan 0.3: pip install -c constraints.txt "
                                         "-e '.[test,torchtitan]' (docs/integrations-torchtitan.md)")

from streamforge import ConfigError  # noqa: E402
from streamforge.cli import main as cli  # noqa: E402

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "helpers" / "workers" / "torchtitan_worker.py"
DOC = ROOT / "docs" / "integrations-torchtitan.md"
SAVE_AT, STEPS = 4, 8  # as in the worker


def _torchrun(out: Path, mode: str, dp: int, replicas: int, urls: list[str]) -> None:
    torchrun(WORKER, out, mode, dp, replicas, *urls, nproc=dp * replicas)


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan-corpus")
    rng = np.random.default_rng(11)
    out = []
    for name, n, median in (("web", 60, 30), ("code", 20, 80)):
        out.append(str(root / name))
        write_stream(out[-1], random_docs(rng, n, median))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, urls):
    """The uninterrupted runs, on DP 2 and on DP 2 x 2, each with its checkpoints and ledger."""
    made = {}
    for dp, replicas in ((2, 1), (2, 2)):
        out = tmp_path_factory.mktemp(f"run-{dp}x{replicas}")
        _torchrun(out, "run", dp, replicas, urls)
        made[dp, replicas] = out
    return made


def _restart_from(run: Path, where: Path) -> Path:
    """A new job's folder holding the run's checkpoints and ledger, as a restart finds them."""
    for name in ("ckpt", "ledger"):
        shutil.copytree(run / name, where / name)
    return where


def _rows(out: Path, mode: str, processes: int) -> list[dict[int, dict]]:
    return [{row["step"]: row for row in map(json.loads, (out / f"{mode}-p{p}.jsonl").read_text().splitlines())}
            for p in range(processes)]


def _reports(out: Path, mode: str, processes: int) -> list[dict]:
    return [json.loads((out / f"{mode}-p{p}.json").read_text()) for p in range(processes)]


@pytest.mark.parametrize("dp,replicas", [(2, 1), (2, 2)])
def test_a_checkpoint_manager_restart_trains_the_uninterrupted_runs_batches(runs, urls, tmp_path, dp, replicas):
    processes = dp * replicas
    run = runs[dp, replicas]
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == [f"step-{SAVE_AT}", f"step-{STEPS}"]
    out = _restart_from(run, tmp_path)
    _torchrun(out, "resume", dp, replicas, urls)
    want, got = _rows(run, "run", processes), _rows(out, "resume", processes)
    for p in range(processes):
        assert sorted(want[p]) == list(range(1, STEPS + 1)) and sorted(got[p]) == list(range(SAVE_AT + 1, STEPS + 1))
        for step, row in got[p].items():
            assert row == want[p][step], f"process {p} step {step}: another batch or loss"
    reports = _reports(out, "resume", processes)
    assert {r["resume"] for r in reports} == {"exact"}
    assert {(r["step"], r["loader_step"]) for r in reports} == {(STEPS, STEPS)}  # one batch a step here
    assert len({r["digest"] for r in reports + _reports(run, "run", processes)}) == 1  # one state, every process
    assert reports[0]["device"] == "cpu" and reports[0]["dtypes"] == ["torch.int64"] * 3
    by_dp = [[p for p in range(processes) if want[p][1]["dp"] == d] for d in range(dp)]
    assert [len(ps) for ps in by_dp] == [replicas] * dp
    for ps in by_dp:  # replicas: the same batches
        assert all(want[p] == want[ps[0]] for p in ps)
    assert all(want[by_dp[0][0]][s]["input"] != want[by_dp[1][0]][s]["input"] for s in want[0])  # dp ranks differ


def test_a_dp2_checkpoint_resumes_elastically_on_dp4_with_every_token_once(runs, urls, tmp_path):
    out = _restart_from(runs[2, 1], tmp_path)
    _torchrun(out, "drain", 4, 1, urls)
    reports = _reports(out, "drain", 4)
    assert {r["resume"] for r in reports} == {"elastic"}
    assert len({r["digest"] for r in reports}) == 1
    rows = _rows(out, "drain", 4)
    assert min(rows[0]) == SAVE_AT + 1 and len({max(r) for r in rows}) == 1
    assert [row[SAVE_AT + 1]["dp"] for row in rows] == [0, 1, 2, 3]
    report = _ledger(out / "ledger")
    assert report["ok"], report["problems"]  # no token delivered twice, before and after the restart
    assert [(r["mode"], r["resumed_at_step"], r["world_size"]) for r in report["ledger"]["restarts"]] == [
        ("fresh", 0, 2), ("elastic", SAVE_AT, 4)]
    (whole,) = report["passes"]
    assert whole["complete"] and 0 <= whole["not_delivered_tokens"] <= whole["drop_bound"]


def _ledger(url: Path) -> dict:
    from streamforge import read_ledger
    from streamforge.ledger.report import check

    assert cli(["ledger", "check", "--no-manifests", str(url)]) == 0
    return check(read_ledger(str(url)))


def _registry_block() -> str:
    """The config-registry module of docs/integrations-torchtitan.md (its block defining
    ``llama3_debugmodel_streamforge``)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "def llama3_debugmodel_streamforge" in b]
    return block


def test_the_docs_config_registry_function_builds_the_loader(urls, tmp_path, monkeypatch):
    pytest.importorskip("triton", reason="torchtitan's model configs import triton, which CUDA builds of torch bring "
                                         "(on a CPU-only machine: pip install triton)")
    from torchtitan.config import ConfigManager

    from streamforge.integrations.torchtitan import StreamforgeDataLoader

    (tmp_path / "streamforge_registry.py").write_text(_registry_block())
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ConfigManager().parse_args([
        "--module", "streamforge_registry", "--config", "llama3_debugmodel_streamforge",
        "--dataloader.streams", ",".join(urls), "--dataloader.seed", "7", "--training.seq_len", "64"])
    assert type(config.dataloader) is StreamforgeDataLoader.Config
    assert (config.dataloader.streams, config.dataloader.seed) == (urls, 7)
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=config.training.seq_len,
                                     local_batch_size=config.training.local_batch_size, snapshot_every_n_steps=None)
    inputs, labels = next(iter(loader))
    shape = (config.training.local_batch_size, 64)
    assert set(inputs) == {"input", "positions"} and inputs["input"].shape == inputs["positions"].shape == labels.shape == shape
    same_doc = inputs["positions"][:, 1:] != 0  # position 0: a document piece starts there
    assert (labels[:, :-1][same_doc] == inputs["input"][:, 1:][same_doc]).all()  # labels: the next token, shifted once
    assert (labels[:, :-1][~same_doc] == -100).all()  # nothing predicted across a document end
    assert int(inputs["input"].max()) < 2048  # the debug model's vocabulary


def test_the_config_is_checked(urls):
    from streamforge.integrations.torchtitan import StreamforgeDataLoader

    build = dict(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=32, local_batch_size=2)
    with pytest.raises(ConfigError, match="names no stream"):
        StreamforgeDataLoader.Config().build(**build)
    with pytest.raises(ConfigError, match="2 stream.s. and 1 weights"):
        StreamforgeDataLoader.Config(streams=urls, weights=[1.0]).build(**build)
    one = StreamforgeDataLoader.Config(dataset_path=urls[0], passes=2).build(**build)
    one.load_state_dict({})  # torchtitan's convention: an empty state is nothing to load
    assert one.resume_report is None
    steps = [labels.shape for _, labels in one]
    assert len(steps) == one.step > 0 and one.loader.clock.pass_idx == 2  # two passes, then the end
