"""The demo: its corpus, and a shortened run whose claim (the resumed loss curve equals the
reference bit for bit) the test checks itself from the files the demo writes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from streamforge.demo.run import EOS_ID, RESULTS, STREAMS, VOCAB_SIZE, build_corpus, document_lengths, main
from streamforge.demo.report import compare
from streamforge.source import read_records


def test_corpus_has_the_three_streams_in_their_shares(tmp_path):
    manifests = build_corpus(tmp_path, 200_000, seed=0)
    assert list(manifests) == [s.name for s in STREAMS]
    total = sum(m.num_tokens for m in manifests.values())
    for spec in STREAMS:
        m = manifests[spec.name]
        assert m.eos_id == EOS_ID and m.vocab_size == VOCAB_SIZE and m.token_dtype == "uint16"
        assert m.num_shards >= min(2, m.num_records)
        assert m.num_tokens / total == pytest.approx(spec.weight, abs=0.05)
    code = list(read_records(str(tmp_path / "code"), 0))
    assert all(0 < len(d) and d.max() < EOS_ID for d in code)
    # arithmetic sequences mod EOS_ID with a few noise tokens: most steps repeat the last one
    d = next(d.astype(np.int64) for d in code if len(d) > 20)
    steps = np.diff(d) % EOS_ID
    assert np.mean(steps == np.bincount(steps).argmax()) > 0.7


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


@pytest.mark.parametrize("argv,message", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--steps", "10", "--checkpoint-at", "10"], "--checkpoint-at must be in 1..9"),
])
def test_bad_arguments_exit_with_usage(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_compare_names_the_first_differing_step():
    phases = [{"phase": 0, "shares": {"a": 1.0}}]
    ref = {"loss_bits": ["0x1.0p+0", "0x1.1p+0", "0x1.2p+0", "0x1.3p+0"], "stats": {"phases": phases}}
    good = {"first_step": 2, "loss_bits": ["0x1.2p+0", "0x1.3p+0"], "stats": {"phases": phases}}
    assert compare(ref, good, 2)[0]
    bad = {**good, "loss_bits": ["0x1.2p+0", "0x1.3000000000001p+0"]}
    ok, lines = compare(ref, bad, 2)
    assert not ok and "first at step 3" in lines[0]


TINY = ["--tokens", "200k", "--steps", "24", "--checkpoint-at", "9", "--switch-at", "12", "--seq-len", "64",
        "--batch-size", "4", "--d-model", "32", "--num-layers", "1"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_resumed_loss_curve_is_the_reference_bit_for_bit(tmp_path, capsys, where):
    argv = ["--output-dir", str(tmp_path), *TINY]
    if where == "s3":
        pytest.importorskip("moto.server")
        argv += ["--s3", "--num-workers", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    ref, resumed = (json.loads((tmp_path / name).read_text()) for name in RESULTS)
    # the claim, checked here from the raw losses: 24 reference steps, the last 15 resumed
    assert len(ref["losses"]) == 24 and resumed["first_step"] == 9
    assert resumed["loss_bits"] == ref["loss_bits"][9:]
    assert resumed["losses"] == ref["losses"][9:]
    assert ref["losses"][0] != ref["losses"][-1]  # it trained
    # two phases, the switch at step 12, the same realized mixture after the resume (12 steps
    # of 256 tokens are too few for shares near the weights: one book is 3,000 tokens)
    phases = ref["stats"]["phases"]
    assert [p["first_step"] for p in phases] == [0, 12]
    assert resumed["stats"]["phases"] == phases
    for phase, key in zip(phases, ("weight", "late_weight")):
        assert phase["weights"] == pytest.approx({s.name: getattr(s, key) for s in STREAMS})
        assert sum(phase["tokens"].values()) == 12 * 4 * 64
    assert "EQUAL" in out and "tokens/s" in out and "phase 1 (steps 12-23)" in out
    assert (tmp_path / "checkpoint-step-9.pt").exists() and str(tmp_path / "checkpoint-step-9.pt") in out
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    if where == "s3":
        assert "loopback S3 at http://127.0.0.1:" in out
        assert ref["stats"]["streams"]["web"]["bytes_fetched"] > 0
