"""Configuration mistakes get a ``ConfigError`` or a warning that names them, before any
batch: never a silent cast, a bare error at the first batch, or a loop that never ends."""

import json
import shutil
import warnings

import numpy as np
import pytest

from helpers.pipeline import write_stream
from streamforge import ConfigError, PackedTokenDataset, Stream, StreamingLoader


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    root = tmp_path_factory.mktemp("config")
    write_stream(str(root / "web"), [np.arange(1, 50, dtype=np.uint16)] * 50)
    write_stream(str(root / "blank"), [np.zeros(0, np.uint16)] * 5)  # documents without a token
    shutil.copytree(root / "blank", root / "none")  # a manifest of no shard at all
    manifest = json.loads((root / "none" / "index.json").read_text())
    manifest["shards"] = {k: [] for k in manifest["shards"]}
    manifest.update(num_shards=0, num_records=0, num_bytes=0, num_tokens=0)
    (root / "none" / "index.json").write_text(json.dumps(manifest))
    return {name: str(root / name) for name in ("web", "blank", "none")}


@pytest.mark.parametrize("empty", ["blank", "none"])
@pytest.mark.parametrize("alone", [True, False])
def test_an_infinite_pass_over_a_stream_without_tokens_is_refused(urls, empty, alone):
    """It used to re-plan passes forever at 100% CPU."""
    streams = [Stream(urls[empty], name=empty)] if alone else [Stream(urls["web"], name="web"),
                                                               Stream(urls[empty], name=empty)]
    with pytest.raises(ConfigError, match=rf"stream '{empty}' .* has no document with a token.*never end"):
        PackedTokenDataset(streams, seq_len=16, infinite=True, eos_id=0)
    PackedTokenDataset(streams, seq_len=16, eos_id=0)  # a finite pass over it ends


def test_a_finite_pass_of_no_step_warns_and_says_why(urls):
    ds = PackedTokenDataset([urls["web"]], seq_len=16, eos_id=0)
    loader = StreamingLoader(ds, batch_size=1000)
    with pytest.warns(UserWarning, match=r"pass 0 has 0 steps.*2,500 tokens.*1000 row\(s\) x seq_len 16"):
        assert list(loader) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(StreamingLoader(ds, batch_size=4))) > 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(seq_len=1.5), r"seq_len must be an integer, got 1.5"),
    (dict(seq_len="8"), r"seq_len must be an integer, got '8'"),
    (dict(seq_len=0), r"seq_len must be >= 1, got 0"),
    (dict(seq_len=8, eos_id=-1), r"eos_id must be >= 0, got -1"),
    (dict(seq_len=8, eos_id=70_000), r"eos_id 70000 does not fit stream 'stream0'.*uint16, at most 65535"),
    (dict(seq_len=8, pad_id=70_000), r"pad_id 70000 does not fit"),
    (dict(seq_len=8, shuffle_buffer=2.5), r"shuffle_buffer must be an integer"),
])
def test_dataset_arguments_are_checked(urls, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PackedTokenDataset([urls["web"]], **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=1.5), r"batch_size must be an integer, got 1.5"),
    (dict(batch_size="4"), r"batch_size must be an integer, got '4' \(str\)"),
    (dict(batch_size=0), r"batch_size must be >= 1"),
    (dict(batch_size=2, num_workers=-1), r"num_workers must be >= 0"),
    (dict(batch_size=2, prefetch_factor=0), r"prefetch_factor must be >= 1"),
])
def test_loader_arguments_are_checked(urls, kwargs, match):
    ds = PackedTokenDataset([urls["web"]], seq_len=8, eos_id=0)
    with pytest.raises(ConfigError, match=match):
        StreamingLoader(ds, **kwargs)


def test_one_url_under_two_names_warns(urls):
    with pytest.warns(UserWarning, match=r"streams 'a' and 'b' read the same URL .*web: its documents come twice"):
        PackedTokenDataset([Stream(urls["web"], name="a"), Stream(urls["web"] + "/", name="b")], seq_len=8, eos_id=0)


def test_repr_of_a_stream_masks_its_secrets():
    stream = Stream("s3://bucket/web", storage_options={
        "key": "AKIAEXAMPLE", "secret": "wJalrEXAMPLE", "token": None,
        "client_kwargs": {"aws_session_token": "FQoGEXAMPLE", "region_name": "eu-west-1"},
        "endpoint_url": "http://127.0.0.1:9000",
    })
    text = repr(stream)
    for secret in ("AKIAEXAMPLE", "wJalrEXAMPLE", "FQoGEXAMPLE"):
        assert secret not in text and secret not in str(stream)
    assert "eu-west-1" in text and "http://127.0.0.1:9000" in text and "'key': '***'" in text
