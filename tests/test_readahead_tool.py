"""tools/bench_readahead.py keeps working: its main function on a tiny stream, real passes in
fresh processes, the figures it reports taken from ``stats()``."""

from __future__ import annotations

import os
import sys

import numpy as np

from helpers.pipeline import random_docs, write_stream

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

import bench_readahead  # noqa: E402


def test_readahead_tool_runs_on_a_tiny_stream(tmp_path, capsys):
    url = str(tmp_path / "web")
    write_stream(url, random_docs(np.random.default_rng(0), 300, 200), shard_size="64KiB", frame_size="8KiB")
    bench_readahead.main(["--url", url, "--threads", "1", "2", "--budgets", "1", "--repeats", "1", "--no-write"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| pipeline |", "| loader |"))]
    assert len(rows) == 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[3].split()[0]) > 0  # seconds
        assert cells[7].endswith("%") and int(cells[7].rstrip("%").split()[0]) > 0  # the fetch threads were busy
