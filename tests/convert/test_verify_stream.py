"""``verify_stream`` (streamforge/format/verify.py) on good and damaged streams."""

import numpy as np
import pytest

from helpers.convert import random_docs, write_megatron
from streamforge.cli import main
from streamforge.convert import convert
from streamforge.format.manifest import Manifest
from streamforge.format.verify import verify_stream


@pytest.fixture
def stream(tmp_path, rng):
    write_megatron(tmp_path / "c", random_docs(rng, 200, max_len=500))
    convert("megatron", tmp_path / "c", tmp_path / "s", shard_size="32KiB", frame_size="4KiB")
    return tmp_path / "s"


def test_good_stream_has_no_problems(stream, capsys):
    assert verify_stream(str(stream)) == []
    assert main(["verify", str(stream)]) == 0
    assert capsys.readouterr().out.startswith("OK ")


def test_flipped_byte_in_a_frame_is_named(stream, capsys):
    m = Manifest.load(str(stream))
    name = m.shard_names[2]
    path = stream / name
    data = bytearray(path.read_bytes())
    data[m.shards[2].index_offset // 2] ^= 0x40  # inside a compressed frame
    path.write_bytes(bytes(data))
    problems = verify_stream(str(stream))
    assert problems and all(p.startswith(name) for p in problems)
    assert any("sha256" in p for p in problems)
    assert any("frame" in p for p in problems), problems
    assert main(["verify", str(stream)]) == 1
    assert name in capsys.readouterr().err


def test_truncated_shard_is_named(stream, capsys):
    m = Manifest.load(str(stream))
    name = m.shard_names[-1]
    path = stream / name
    path.write_bytes(path.read_bytes()[:-100])
    problems = verify_stream(str(stream))
    assert any(p.startswith(f"{name}: size") for p in problems)
    assert any("index does not decode" in p for p in problems)
    assert main(["verify", str(stream)]) == 1
    err = capsys.readouterr().err
    assert name in err and "size" in err


def test_missing_shard_and_missing_manifest(stream, tmp_path):
    name = Manifest.load(str(stream)).shard_names[0]
    (stream / name).unlink()
    assert verify_stream(str(stream))[0] == f"{name}: missing"
    assert "index.json" in verify_stream(str(tmp_path / "nothing"))[0]
