"""The demo: its corpus builder, and (once the pipeline is importable) a tiny run end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

import streamforge
from streamforge.demo import EOS_ID, STREAMS, VOCAB_SIZE, build_corpus, document_lengths, main
from streamforge.source import read_records

PIPELINE = all(hasattr(streamforge, name) for name in ("PackedTokenDataset", "Stream", "StreamingLoader"))
needs_pipeline = pytest.mark.skipif(
    not PIPELINE, reason="streamforge.PackedTokenDataset/Stream/StreamingLoader are not exported yet"
)


def test_corpus_has_the_three_streams_in_their_shares(tmp_path):
    manifests = build_corpus(tmp_path, 200_000, seed=0)
    assert list(manifests) == [s.name for s in STREAMS]
    total = sum(m.num_tokens for m in manifests.values())
    for spec in STREAMS:
        m = manifests[spec.name]
        assert m.eos_id == EOS_ID and m.vocab_size == VOCAB_SIZE and m.token_dtype == "uint16"
        assert m.num_shards >= min(2, m.num_records)
        assert m.num_tokens / total == pytest.approx(spec.weight, abs=0.05)
    web = list(read_records(str(tmp_path / "web"), 0))
    assert all(0 < len(d) and d.max() < EOS_ID for d in web)
    assert (tmp_path / "web" / "index.json").exists()


def test_corpus_is_deterministic_and_reused(tmp_path):
    a = build_corpus(tmp_path / "a", 100_000, seed=3)
    b = build_corpus(tmp_path / "b", 100_000, seed=3)
    assert [m.fingerprint for m in a.values()] == [m.fingerprint for m in b.values()]
    mtime = (tmp_path / "a" / "web" / "index.json").stat().st_mtime_ns
    again = build_corpus(tmp_path / "a", 100_000, seed=3)
    assert (tmp_path / "a" / "web" / "index.json").stat().st_mtime_ns == mtime
    assert again["web"].fingerprint == a["web"].fingerprint
    c = build_corpus(tmp_path / "a", 100_000, seed=4)  # other parameters replace it
    assert c["web"].fingerprint != a["web"].fingerprint


def test_lognormal_lengths_have_the_asked_median():
    spec = STREAMS[0]
    lengths = document_lengths(spec, 3_000_000, np.random.default_rng(0))
    assert lengths.min() >= 1
    assert np.median(lengths) == pytest.approx(spec.median_len, rel=0.1)
    assert lengths.sum() >= 3_000_000 > lengths[:-1].sum()


def test_bad_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--batch-size", "0"])
    assert info.value.code == 2
    assert "--batch-size must be >= 1" in capsys.readouterr().err


@needs_pipeline
@pytest.mark.parametrize("num_workers", [0, 2])
def test_tiny_demo_end_to_end(tmp_path, capsys, num_workers):
    argv = [
        "--output-dir", str(tmp_path), "--tokens", "300k", "--seq-len", "256",
        "--batch-size", "4", "--max-batches", "40", "--resume-at", "10",
        "--num-workers", str(num_workers),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "exact resume: OK" in out, out
    assert "streamed 40 batches" in out, out
    assert "mixture" in out and "web" in out and "books" in out
    state = json.loads((tmp_path / "state-batch-10.json").read_text())
    assert isinstance(state, dict)


@needs_pipeline
def test_demo_without_resume_check(tmp_path, capsys):
    argv = ["--output-dir", str(tmp_path), "--tokens", "100k", "--seq-len", "128",
            "--batch-size", "2", "--max-batches", "5", "--no-resume-check"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "streamed 5 batches" in out and "exact resume" not in out
