"""tools/bench_plan_scale.py keeps working: its main function on a tiny configuration."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

import bench_plan_scale  # noqa: E402


def test_plan_scale_tool_runs_on_a_tiny_configuration(capsys):
    assert bench_plan_scale.main([
        "--shards", "40,20,8", "--records", "30,20,6", "--topologies", "1x1,2x2,4x2",
        "--elastic", "4x2:3x2", "--window", "8", "--repeats", "1", "--agree-ranks", "2", "--no-write",
        "--shard-sweep", "1,2", "--sweep-topology", "2x2", "--requests-topology", "4x2",
    ]) == 0
    out = capsys.readouterr().out
    assert "| 4x2 | 8 |" in out
    assert "NO (" not in out  # every sampled rank computed the same plan
    assert "`remaining_plan` 4x2 -> 3x2" in out
    assert "Plan time against shards at 2x2" in out and "| 136 |" in out  # 68 shards, then twice as many
    assert "index GETs to plan, alone" in out and "GETs per GB" in out and "start burst" in out
