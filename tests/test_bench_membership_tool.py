"""tools/bench_membership.py keeps working: its main function on a tiny configuration."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

import bench_membership  # noqa: E402


def test_membership_tool_runs_on_a_tiny_configuration(capsys, tmp_path):
    assert bench_membership.main(["--participants", "4", "--segment-steps", "2,4", "--seq-len", "32",
                                  "--repeats", "1", "--root", str(tmp_path), "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "4 participants x 1 worker(s)" in out
    assert "| 2 | 256 |" in out and "| 4 | 512 |" in out  # tokens replayed: S x 4 participants x 32
