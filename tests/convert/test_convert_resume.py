"""A text conversion killed midway (SIGKILL of the driver and its worker processes) is rerun
with the same command: verified shards are kept, the rest redone, the output identical."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import fsspec
import pytest

pytest.importorskip("tokenizers", reason="text conversion tests need the 'text' extra (tokenizers)")

from helpers.text import make_docs, split_files, train_hf, tree_digests  # noqa: E402

from streamforge.cli import main  # noqa: E402


def command(src, out, tok):
    return ["convert", "--from", "jsonl", "--input", str(src), "--output", str(out),
            "--text-field", "text", "--tokenizer", tok, "--shard-size", "16KiB", "--workers", "2"]


def complete(receipt) -> bool:
    """A receipt the kill did not cut short (a torn one is ignored by the rerun)."""
    try:
        json.loads(receipt.read_bytes())
        return True
    except ValueError:
        return False


def test_killed_conversion_resumes_to_identical_output(tmp_path, rng):
    docs = make_docs(rng, 16_000)
    split_files(tmp_path / "in", docs, 40, ".jsonl.gz")
    tok = train_hf(tmp_path / "tokenizer.json", docs[:2000])
    fs = fsspec.filesystem("file")
    assert main(command(tmp_path / "in", tmp_path / "ref", tok)) == 0
    reference = tree_digests(fs, str(tmp_path / "ref"))

    out = tmp_path / "out"
    state = out / "_convert-state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamforge.cli", *command(tmp_path / "in", out, tok)],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if state.exists() and len(list(state.glob("shard-*.json"))) >= 6:
            break
        time.sleep(0.005)
    assert proc.poll() is None, f"the conversion ended before it could be killed: {proc.stderr.read()}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "index.json").exists()
    receipts = sorted(p.name[: -len(".json")] for p in state.glob("shard-*.json") if complete(p))
    assert receipts, "no shard was finished before the kill"
    written = {name: (out / name).stat().st_mtime_ns for name in receipts}
    damaged = receipts[0]
    with open(out / damaged, "r+b") as f:  # a kept shard that no longer matches its receipt
        f.truncate(100)

    assert main(command(tmp_path / "in", out, tok)) == 0
    assert tree_digests(fs, str(out)) == reference
    assert not state.exists()
    kept = [n for n in receipts[1:] if (out / n).stat().st_mtime_ns == written[n]]
    assert kept == receipts[1:], "verified shards were rewritten"
