"""tools/bench_read_once.py keeps working: one tiny run of each variant (torchrun of 4 gloo
processes on a (2, 2) mesh, local files), both in its table, the replicas with read_once
fetching no shard byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_read_once.py"


def test_read_once_tool_runs_both_variants_on_a_tiny_corpus():
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--steps", "10", "--repeats", "1", "--tokens", "2e5", "--storage", "local",
         "--no-write"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith(("| default |", "| read_once |"))]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (v, str(dp), str(replica)) for v in ("default", "read_once") for dp in range(2) for replica in range(2)]
    fetched = {(r[0], r[2]): float(r[4]) for r in rows}  # pipeline MB, per variant and replica
    assert fetched["default", "0"] > 0 and fetched["default", "1"] > 0 and fetched["read_once", "0"] > 0
    assert fetched["read_once", "1"] == 0  # replica 1 receives its batches
    assert "| replica (replica 1) | pipeline fetched, MB |" in proc.stdout
