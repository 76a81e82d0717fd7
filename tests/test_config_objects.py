"""Settings as objects (ShuffleConfig, PackingConfig, LedgerConfig, EvaluationDataset) give
what the older keywords give, and the loader's batch spec (fields, boundary, provenance)
changes how batches are expanded, never the data order or whether a resume is exact."""

import json

import numpy as np
import pytest

from helpers.pipeline import assert_batches_equal, dataset, loader, make_corpus, take
from streamforge import (
    ConfigError, EvaluationDataset, LedgerConfig, PackedTokenDataset, PackingConfig, ShuffleConfig, StreamingLoader,
    read_ledger, unpack_state,
)
from streamforge.resume.state import fingerprint, pack_state

SMALL = (("web", 60, 40), ("code", 20, 120))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("objects"), np.random.default_rng(3), SMALL)


def _streams(corpus):
    return [corpus[name][0] for name in corpus]


def test_shuffle_and_packing_objects_are_the_keywords(corpus):
    old = PackedTokenDataset(_streams(corpus), seq_len=64, shuffle_buffer=16, shuffle_warmup=2, packing="bestfit",
                             bestfit_window=8, eos_id=0)
    new = PackedTokenDataset(_streams(corpus), seq_len=64, shuffle=ShuffleConfig(buffer=16, warmup=2),
                             packing=PackingConfig("bestfit", bestfit_window=8), eos_id=0)
    assert old.describe() == new.describe()
    assert_batches_equal(take(StreamingLoader(new, batch_size=2)), take(StreamingLoader(old, batch_size=2)))


@pytest.mark.parametrize("kwargs,match", [
    (dict(shuffle=ShuffleConfig(16), shuffle_buffer=32), "shuffle settings once"),
    (dict(packing=PackingConfig("bestfit"), bestfit_window=8), "packing settings once"),
    (dict(shuffle=ShuffleConfig(buffer=0)), "shuffle_buffer must be >= 1"),
    (dict(packing=PackingConfig("zigzag")), "packing must be one of"),
])
def test_settings_are_given_once_and_checked(corpus, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PackedTokenDataset(_streams(corpus), seq_len=64, eos_id=0, **kwargs)


def test_an_evaluation_dataset_is_the_evaluation_keyword(corpus):
    old = PackedTokenDataset(_streams(corpus), seq_len=64, eos_id=0, evaluation=True, eval_tokens=2000)
    new = EvaluationDataset(_streams(corpus), seq_len=64, eos_id=0, eval_tokens=2000)
    assert new.evaluation and old.describe() == new.describe()
    assert_batches_equal(take(StreamingLoader(new, batch_size=2)), take(StreamingLoader(old, batch_size=2)))


def test_a_ledger_config_is_the_ledger_keywords(corpus, tmp_path):
    for name, kwargs in (("config", dict(ledger=LedgerConfig(str(tmp_path / "a"), chunk_steps=5))),
                         ("keywords", dict(ledger_dir=str(tmp_path / "b")))):
        ldr = loader(dataset(corpus), **kwargs)
        take(ldr, 12)
        ldr.state_dict()
        assert ldr.ledger is not None, name
    a, b = read_ledger(str(tmp_path / "a")), read_ledger(str(tmp_path / "b"))
    assert len(a.steps["step"]) == len(b.steps["step"]) == 12
    with pytest.raises(ConfigError, match="ledger once"):
        loader(dataset(corpus), ledger=LedgerConfig(str(tmp_path / "c")), ledger_dir=str(tmp_path / "d"))


def test_the_batch_spec_changes_batches_not_the_order_or_the_resume(corpus):
    plain = loader(dataset(corpus))
    head = take(plain, 5)
    state = plain.state_dict()
    spec = loader(dataset(corpus), provenance=True, boundary="stream")
    spec.load_state_dict(json.loads(json.dumps(state)))
    assert spec.resume_report.mode == "exact", str(spec.resume_report)
    tail = take(spec, 3)
    assert "segments" in tail[0] and "segments" not in head[0]
    want = take(plain, 3)
    for got, ref in zip(tail, want):
        assert (got["input_ids"] == ref["input_ids"]).all()  # the same tokens in the same places
    with pytest.raises(ConfigError, match="boundary must be one of"):
        loader(dataset(corpus), boundary="page")


def test_a_state_that_saved_the_batch_spec_in_its_config_still_resumes_exactly(corpus):
    """States written before the batch spec moved to the loader hold boundary and provenance
    in their config, and their fingerprint covers them."""
    first = loader(dataset(corpus))
    take(first, 4)
    inner = unpack_state(first.state_dict())
    inner["config"] = {**inner["config"], "boundary": "document", "provenance": False}
    inner["fingerprint"] = fingerprint(inner["config"])
    resumed = loader(dataset(corpus))
    resumed.load_state_dict(pack_state(inner))
    assert resumed.resume_report.mode == "exact", str(resumed.resume_report)
    assert_batches_equal(take(resumed, 3), take(first, 3))
