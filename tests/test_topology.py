"""The topology cannot silently disagree with torch.distributed (torchrun, 2 gloo processes):

* a dataset built before the process group (no environment, or ``WORLD_SIZE`` without
  ``RANK``, as in a Lightning DataModule's ``__init__``) reads the shards of the rank the group
  gives it once iteration starts: the same batches as a dataset built after;
* ``rank=``/``world_size=`` that disagree with the group are a ``ConfigError`` naming both
  values and where each came from;
* half an environment without a process group is a ``ConfigError``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers.pipeline import random_docs, write_stream
from helpers.torchrun import torchrun
from streamforge.errors import ConfigError
from streamforge.topology import Topology

WORKER = Path(__file__).parent / "helpers" / "workers" / "topology_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("topology")
    url = str(root / "web")
    write_stream(url, random_docs(np.random.default_rng(0), 60, 40))
    torchrun(WORKER, root, url)
    return [json.loads((root / f"topology-p{r}.json").read_text()) for r in range(2)]


def test_a_dataset_built_before_the_process_group_reads_its_ranks_shards(results):
    for rank, got in enumerate(results):
        assert got["pending_source"] == "pending"
        for case in ("no_env", "world_size_only"):
            assert (got[case]["rank"], got[case]["world_size"]) == (rank, 2), case
            assert got[case]["source"] == "torch.distributed"
            assert got[case]["tokens"] == got["after_group"]["tokens"], case
    assert results[0]["after_group"]["tokens"] != results[1]["after_group"]["tokens"]


def test_a_topology_that_disagrees_with_the_group_is_named(results):
    assert "error" not in results[0]["wrong_rank"]  # rank 0 of 2 is what process 0 is
    assert results[1]["wrong_rank"]["error"] == (
        "rank 0 of 2 (explicit) disagrees with torch.distributed's rank 1 of 2")
    for got in results:
        assert "rank 0 of 1 (explicit) disagrees with torch.distributed's" in got["wrong_world"]["error"]
        assert "pass mesh= or the data-parallel group=" in got["wrong_world"]["error"]


def test_half_an_environment_without_a_group_is_an_error(results, monkeypatch):
    for got in results:
        assert "the environment sets WORLD_SIZE but not RANK" in got["half_env_without_group"]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    pending = Topology.resolve()
    assert pending.source == "pending"
    with pytest.raises(ConfigError, match="the environment sets RANK but not WORLD_SIZE"):
        pending.checked()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert pending.checked() == Topology(1, 2)
