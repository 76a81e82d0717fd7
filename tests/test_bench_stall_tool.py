"""tools/bench_stall.py keeps working through the latency proxy (issue #39's stall case): its
2-worker, 20 ms-step case reads S3 through tools/peers/latency_proxy.py at 25 ms and 100 MB/s,
and reports the stall, the longest wait, the proxy's counts and the target's verdict, without
touching the docs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "bench_stall.py")


def test_stall_case_through_the_latency_proxy(tmp_path):
    pytest.importorskip("moto")
    cmd = [sys.executable, TOOL, "--quick", "--out", str(tmp_path), "--latency-ms", "25", "--bandwidth-mbps", "100",
           "--backends", "latency", "--modes", "2 workers", "--steps", "20"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"S3, 25 ms \+ 100 MB/s\s+2 workers\s+20 ms: stall\s+[\d.]+%", text), text
    requests, megabytes = re.search(r"latency proxy: (\d+) requests, ([\d.]+) MB", text).groups()
    assert int(requests) > 0 and float(megabytes) > 0  # the loader read through the proxy
    assert re.search(r"Target \(20 ms steps, S3, 25 ms \+ 100 MB/s, 2 workers\): .*longest wait [\d.]+ ms: "
                     r"(met|\*\*missed\*\*)\.", text), text
