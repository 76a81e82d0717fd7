"""tools/bench_against.py keeps working: a resume comparison of this tree with HEAD on a tiny
stream, real loaders with worker processes in fresh processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers.pipeline import random_docs, write_stream

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")
sys.path.insert(0, TOOLS)

import bench_against  # noqa: E402


@pytest.mark.skipif(shutil.which("git") is None or subprocess.run(
    ["git", "rev-parse", "HEAD"], cwd=TOOLS, capture_output=True).returncode != 0,
    reason="needs a git checkout with a HEAD to compare with")
def test_against_tool_times_resumes_at_each_position(tmp_path, capsys):
    url = str(tmp_path / "web")
    write_stream(url, random_docs(np.random.default_rng(0), 400, 1500, min_len=1), shard_size="1MiB",
                 frame_size="16KiB")
    bench_against.main(["--rev", "HEAD", "--resume", "--url", url, "--workers", "2", "--repeats", "1",
                        "--positions", "0.2", "0.7", "--no-write"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "/" in line.split("|")[1]]
    assert len(rows) == 2, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for cell in cells[1:3]:  # total (build / load / first), in ms
            total, parts = cell.split(" ", 1)
            assert float(total) > 0 and len(parts.strip("()").split(" / ")) == 3
        assert float(cells[3]) > 0
