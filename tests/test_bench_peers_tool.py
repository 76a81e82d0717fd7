"""tools/bench_peers.py keeps working: its streamforge path (corpus, writer, ceilings, a pass in
a fresh process, resume from saved states with the exactness check) on a tiny corpus, without
touching the docs. Peers that are installed are left out to keep this to seconds; peers that
are not installed must show up in the report with the reason."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "bench_peers.py")
# system: (package that must be there, its row's name in the report)
PEERS = {"grain": ("grain", "Grain (ArrayRecord), as torchtitan builds it"),
         "litdata-raw": ("litdata", "LitData, uncompressed chunks"),
         "mosaic": ("mosaicml-streaming", "MosaicML Streaming (MDS)")}


def installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_streamforge_path_of_the_peers_benchmark(tmp_path):
    absent = [system for system, (package, _) in PEERS.items() if not installed(package)]
    cmd = [sys.executable, TOOL, "--tokens", "4e5", "--repeats", "1", "--systems", "streamforge", *absent,
           "--backends", "local", "--workers", "0", "--resume-workers", "0", "--resume-check", "4",
           "--no-growth", "--no-write", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "bench.md")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    text = out.stdout
    assert "| streamforge | 0 | local disk |" in text
    assert "| ceiling: packing a flat np.memmap | 0 | local disk |" in text
    assert "| ceiling: the full batch contract from a flat np.memmap | 0 | local disk |" in text
    assert "| ceiling: raw zstd decoding of the shards | 0 | local disk |" in text
    # the memory comparison: equal output (input_ids + labels) at WebDataset's settings
    assert "| streamforge, input_ids + labels, at WebDataset's settings | 0 | local disk |" in text
    targets = text[text.index("| target | streamforge | against | ratio | |"):]
    assert "| 0 workers, local >= 50% of raw zstd decoding" in targets
    resume = [line for line in text.splitlines() if line.startswith("| streamforge |") and "batches checked" in line]
    assert len(resume) == 1 and resume[0].count(", exact (") == 3, resume
    for system in absent:  # a peer that is not there is reported with the reason, never dropped
        package, name = PEERS[system]
        assert f"| {name} | not written: `{package}` is not installed" in text
    assert not (tmp_path / "bench.md").exists()
    # the report again from the saved results, measuring nothing: the same tables
    again = subprocess.run(cmd + ["--report-only"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert text[text.index("| system | workers |"):] == again.stdout[again.stdout.index("| system | workers |"):]


def test_grain_in_the_peers_benchmark(tmp_path):
    """Grain as torchtitan builds it, on a tiny corpus: its ArrayRecord copy, a pass with 0 and
    2 workers (mp_prefetch), resume through get_state/set_state checked batch for batch, and
    its S3 cells reported as not runnable with the reason (no S3 server is needed for that)."""
    if not (installed("grain") and installed("array-record")):
        import pytest

        pytest.skip("grain and array-record are not installed here (they come with the bench extra: make venv-bench)")
    cmd = [sys.executable, TOOL, "--tokens", "4e5", "--repeats", "1", "--systems", "grain",
           "--backends", "local", "s3", "--workers", "0", "2", "--resume-workers", "2", "--resume-check", "4",
           "--no-growth", "--no-write", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "bench.md")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    name = PEERS["grain"][1]
    rows = [line for line in out.stdout.splitlines() if line.startswith(f"| {name} |")]
    assert any(line.startswith(f"| {name} | 0 | local disk | ") and "not runnable" not in line for line in rows), rows
    assert any(line.startswith(f"| {name} | 2 | local disk | ") and "not runnable" not in line for line in rows), rows
    resume = [line for line in rows if "batches checked" in line]
    assert len(resume) == 1 and resume[0].count(", exact (") == 3, resume
    assert "ArrayRecord files (`ArrayRecordWriter(path, 'group_size:1')`" in out.stdout
    for w in (0, 2):
        assert any(line.startswith(f"| {name} | {w} | loopback S3 | not runnable: Grain reads local paths only")
                   for line in rows), rows


def test_a_case_s_peak_memory_ends_at_its_result_line():
    """The harness samples a case's memory until the case reports: what its interpreter's
    teardown touches after that (torch's CUDA build: about 110 MiB of library pages for 20 ms)
    is not the case's, and a 50 ms sampler caught it or not by chance."""
    import tempfile

    sys.path.insert(0, os.path.dirname(TOOL))
    from peers.harness import MARKER, watch

    def peak(before: bool) -> int:
        grow = "b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.4)"
        lines = [grow, f"print({MARKER!r} + '{{}}', flush=True)", "time.sleep(0.3)"]
        if not before:
            lines = [lines[1], "time.sleep(0.2)", grow]
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.Popen([sys.executable, "-c", "import time\n" + "\n".join(lines)], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            return watch(proc, log, timeout=30, every=0.02)

    assert peak(before=True) > 256 << 20
    assert peak(before=False) < 128 << 20
