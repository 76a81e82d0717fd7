"""The ``streamforge`` command through ``streamforge.cli.main``."""

import json

import numpy as np

from streamforge.cli import length_histogram, main, storage_options, build_parser
from streamforge.format.manifest import Manifest


def write_flat(path, rng, eos=0):
    docs = [np.append(rng.integers(1, 1000, size=n), eos).astype(np.uint16) for n in rng.integers(0, 300, 50)]
    np.concatenate(docs).tofile(path)
    return docs


def test_convert_inspect_verify(tmp_path, rng, capsys):
    docs = write_flat(tmp_path / "t.bin", rng)
    out = tmp_path / "out"
    rc = main(["convert", "--from", "flat", "--input", str(tmp_path / "t.bin"), "--output", str(out),
               "--eos-id", "0", "--shard-size", "8KiB", "--vocab-size", "1000", "--workers", "1"])
    assert rc == 0
    m = Manifest.load(str(out))
    assert m.num_records == len(docs) and m.vocab_size == 1000 and m.eos_id == 0
    assert "shards" in capsys.readouterr().out

    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"records      {len(docs)}" in text and "compression" in text and "uint16" in text
    assert "length histogram" in text

    assert main(["verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith("OK")


def test_convert_errors_exit_nonzero_with_the_file(tmp_path, capsys):
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02")
    rc = main(["convert", "--from", "flat", "--input", str(tmp_path / "t.bin"), "--output",
               str(tmp_path / "out"), "--eos-id", "0"])
    assert rc == 2
    assert "t.bin" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_storage_options_from_flags():
    args = build_parser().parse_args(
        ["inspect", "s3://b/x", "--endpoint-url", "http://h:9", "--storage-option", "anon=true",
         "--storage-option", "key=k"]
    )
    assert storage_options(args) == {"anon": True, "key": "k", "client_kwargs": {"endpoint_url": "http://h:9"}}


def test_histogram_buckets():
    lines = length_histogram(np.array([0, 1, 2, 3, 4, 600, 700]))
    assert [l.split()[0] for l in lines] == ["0-0", "1-1", "2-3", "4-7", "512-1,023"]


def test_convert_into_s3_via_cli(tmp_path, rng, s3_bucket):
    bucket, opts = s3_bucket
    write_flat(tmp_path / "t.bin", rng)
    url = f"s3://{bucket}/cli"
    extra = ["--endpoint-url", opts["client_kwargs"]["endpoint_url"], "--storage-option", "key=testing",
             "--storage-option", "secret=testing"]
    assert main(["convert", "--from", "flat", "--input", str(tmp_path / "t.bin"), "--output", url,
                 "--eos-id", "0", *extra]) == 0
    assert main(["verify", url, *extra]) == 0


def test_plan_prints_the_cuts_the_job_reads(tmp_path, rng, capsys):
    """`streamforge plan` shows each worker's ranges as the dataset's planner cuts them (exact
    cuts), and its token counts add up to the stream's."""
    from helpers.pipeline import random_docs, write_stream
    from streamforge import PackedTokenDataset

    url = str(tmp_path / "web")
    write_stream(url, random_docs(rng, 300, 60))
    assert main(["plan", url, "--world-size", "2", "--workers", "3"]) == 0
    out = capsys.readouterr().out
    ds = PackedTokenDataset(url, seq_len=64, rank=0, world_size=2)
    for g, ranges in enumerate(ds.planner.ranges(0, 0, 6)):
        shown = " ".join(f"{s}[{a}:{b}]" for s, a, b in ranges[:6])
        assert shown in out, (g, shown)
    totals = [int(line.split(": ")[1].split()[0].replace(",", "")) for line in out.splitlines() if "(global" in line]
    assert sum(totals) == Manifest.load(url).num_tokens
