"""Conversions as an unlucky user runs them (issue 35, items 11 and 12, converter errors).

A re-run killed with SIGKILL at several points leaves the prefix as the old complete stream
(every file it lists untouched) or the new one, never a mix, on a local disk and on S3. A
killed coordinator's worker processes die with it. An output path that is a regular file
and a Megatron ``.bin`` longer than its ``.idx`` are named.

The CLI runs in a forked child (``main(argv)``, exactly what ``streamforge convert`` runs)
rather than a fresh interpreter: importing streamforge again costs seconds per run.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import fsspec
import numpy as np
import pytest

from helpers.convert import random_docs, read_stream, write_megatron
from streamforge.cli import main
from streamforge.convert import convert
from streamforge.errors import ConfigError
from streamforge.format.manifest import Manifest
from streamforge.format.verify import verify_stream
from streamforge.format.writer import ShardWriter

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, /proc")

LAYOUT = ["--shard-size", "8KiB", "--frame-size", "4KiB", "--compression-level", "19"]


def _run_cli(argv: list[str]) -> None:
    os.environ["STREAMFORGE_NO_PROGRESS"] = "1"
    os._exit(main(argv))


def start_cli(argv: list[str]) -> multiprocessing.Process:
    proc = multiprocessing.get_context("fork").Process(target=_run_cli, args=(argv,))
    proc.start()
    return proc


def convert_argv(src, url: str, *extra: str) -> list[str]:
    return ["convert", "--from", "megatron", "--input", str(src), "--output", url, *LAYOUT, *extra]


def stamps(fs, path: str) -> dict[str, tuple]:
    """Shard file name -> (size, and whatever tells a rewrite: inode and mtime, or ETag)."""
    fs.invalidate_cache(path)
    try:
        items = fs.ls(path, detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    for info in items:
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("shard-"):
            out[name] = (info["size"], info.get("ino"), info.get("mtime"), info.get("ETag"))
    return out


def kill_after(proc, fs, path: str, before: dict[str, tuple], count: int) -> None:
    """SIGKILL ``proc`` once ``count`` shard files are new or changed since ``before``."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.exitcode is None:
        now = stamps(fs, path)
        if sum(now[n] != before.get(n) for n in now) >= count:
            break
        time.sleep(0.002)
    assert proc.exitcode is None, f"the conversion ended (exit {proc.exitcode}) before it was killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()


def assert_old_or_new(url, opts, fs, path, old: Manifest, before, candidates) -> str:
    """The prefix opens as ``old`` with every file it lists untouched since ``before``, or as
    one of the ``candidates`` (name -> documents) in full; returns which."""
    assert verify_stream(url, opts) == []
    manifest, records = read_stream(url, opts)
    now = stamps(fs, path)
    if manifest.fingerprint == old.fingerprint and manifest.shard_names == old.shard_names:
        assert {n: now[n] for n in old.shard_names} == {n: before[n] for n in old.shard_names}, (
            "a shard of the live stream was written over"
        )
    which = [name for name, docs in candidates.items() if _same(records, docs)]
    assert which, "the stream mixes the old and the new conversion"
    assert manifest.num_tokens == sum(len(d) for d in candidates[which[0]])
    return which[0]


def _same(records, docs) -> bool:
    return len(records) == len(docs) and all(np.array_equal(r, d) for r, d in zip(records, docs))


@pytest.mark.parametrize("kind", ["same source", "other source"])
def test_killed_rerun_leaves_the_old_or_the_new_stream(tmp_path, rng, kind):
    old_docs = random_docs(rng, 300, max_len=400, high=300)
    new_docs = random_docs(rng, 300, max_len=400, high=300) if kind == "other source" else old_docs
    old_src, new_src = write_megatron(tmp_path / "x", old_docs), write_megatron(tmp_path / "y", new_docs)
    url, fs = str(tmp_path / "out"), fsspec.filesystem("file")
    assert main(convert_argv(old_src, url)) == 0
    old = Manifest.load(url)
    assert old.num_shards >= 20
    rerun = convert_argv(new_src, url, *(["--overwrite"] if kind == "other source" else []))
    candidates = {"old": old_docs, "new": new_docs}
    for count in (1, old.num_shards // 3, old.num_shards // 2):
        before = stamps(fs, url)
        kill_after(start_cli(rerun), fs, url, before, count)
        assert_old_or_new(url, None, fs, url, old, before, candidates)
    before = stamps(fs, url)
    assert main(rerun) == 0
    new = Manifest.load(url)
    assert_old_or_new(url, None, fs, url, old, before, {"new": new_docs})
    assert sorted(os.listdir(url)) == sorted(["index.json", *new.shard_names])
    assert not set(new.shard_names) & set(old.shard_names)  # no file name of the old stream reused
    assert new.fingerprint == old.fingerprint or kind == "other source"


def test_killed_rerun_on_s3_leaves_the_old_or_the_new_stream(tmp_path, rng, s3_server, s3_bucket):
    bucket, opts = s3_bucket
    url, path = f"s3://{bucket}/stream", f"{bucket}/stream"
    fs = fsspec.filesystem("s3", **opts)
    old_docs = random_docs(rng, 100, max_len=400, high=300)
    new_docs = random_docs(rng, 100, max_len=400, high=300)
    old_src, new_src = write_megatron(tmp_path / "x", old_docs), write_megatron(tmp_path / "y", new_docs)
    s3_args = ["--endpoint-url", s3_server.endpoint_url, "--storage-option", "key=testing",
               "--storage-option", "secret=testing", "--storage-option", "skip_instance_cache=true",
               "--shard-size", "16KiB"]  # fewer, larger objects: each request to moto costs ~10 ms
    assert main(convert_argv(old_src, url, *s3_args)) == 0
    old = Manifest.load(url, opts)
    rerun = convert_argv(new_src, url, "--overwrite", *s3_args)
    before = stamps(fs, path)
    kill_after(start_cli(rerun), fs, path, before, old.num_shards // 2)
    assert assert_old_or_new(url, opts, fs, path, old, before, {"old": old_docs, "new": new_docs}) == "old"
    before = stamps(fs, path)
    assert main(rerun) == 0
    new = Manifest.load(url, opts)
    assert_old_or_new(url, opts, fs, path, old, before, {"new": new_docs})
    assert sorted(stamps(fs, path)) == sorted(new.shard_names)  # the old generation is removed


def test_killed_text_overwrite_keeps_the_old_stream_then_resumes(tmp_path, rng):
    pytest.importorskip("tokenizers")
    from helpers.text import make_docs, split_files, train_hf

    docs = make_docs(rng, 2400)
    tok = train_hf(tmp_path / "tokenizer.json", docs[:500])
    split_files(tmp_path / "a", docs[:1200], 4)
    split_files(tmp_path / "b", docs[1200:], 4)
    url, fs = str(tmp_path / "out"), fsspec.filesystem("file")

    def argv(src, out=url):
        return ["convert", "--from", "jsonl", "--input", str(src), "--output", out, "--text-field",
                "text", "--tokenizer", tok, "--shard-size", "8KiB", "--overwrite"]

    assert main(argv(tmp_path / "a")) == 0
    old = Manifest.load(url)
    _, old_records = read_stream(url)
    before = stamps(fs, url)
    kill_after(start_cli(argv(tmp_path / "b")), fs, url, before, 4)
    assert_old_or_new(url, None, fs, url, old, before, {"old": old_records})
    state = tmp_path / "out" / "_convert-state"
    assert len(list(state.glob("shard-*.json"))) >= 3, "the killed run left no receipts"
    assert main(argv(tmp_path / "b")) == 0  # resumes: the receipts' shards are kept
    new = Manifest.load(url)
    assert main(argv(tmp_path / "b", str(tmp_path / "ref"))) == 0
    reference = Manifest.load(str(tmp_path / "ref"))
    assert new.shard_sha256 == reference.shard_sha256 and new.fingerprint == reference.fingerprint
    assert sorted(os.listdir(url)) == sorted(["index.json", *new.shard_names])


# -- orphaned workers ------------------------------------------------------------------------


def children(pid: int) -> set[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and int(stat[1]) == pid:
                out.add(int(entry))
    return out


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/pid/stat (state, ppid, ...), or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int, start_time: str) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z" and stat[19] == start_time  # not reaped, not reused


def test_workers_die_with_a_killed_parent(tmp_path, rng):
    docs = random_docs(rng, 4000, max_len=800, high=300)
    src = write_megatron(tmp_path / "c", docs)
    out = tmp_path / "out"
    proc = start_cli(convert_argv(src, str(out), "--workers", "2"))
    workers: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.exitcode is None:
            workers = {p: _stat(p)[19] for p in children(proc.pid) if _stat(p) is not None}
            if len(workers) >= 2 and out.exists() and any(out.glob("shard-*")):
                break
            time.sleep(0.01)
        assert proc.exitcode is None and len(workers) >= 2, "no worker processes were seen at work"
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(alive(p, t) for p, t in workers.items()):
            time.sleep(0.02)
        assert not [p for p, t in workers.items() if alive(p, t)], "converter workers outlived their parent"
        files = {p.name: p.stat().st_size for p in out.glob("shard-*")}
        time.sleep(0.5)
        assert {p.name: p.stat().st_size for p in out.glob("shard-*")} == files
        assert not (out / "index.json").exists()
    finally:
        for pid, start in workers.items():
            if alive(pid, start):
                os.kill(pid, signal.SIGKILL)


# -- named errors ----------------------------------------------------------------------------


def test_output_path_that_is_a_regular_file_is_named(tmp_path, rng, capsys):
    src = write_megatron(tmp_path / "c", random_docs(rng, 20))
    target = tmp_path / "taken"
    target.write_bytes(b"not a directory")
    with pytest.raises(ConfigError, match=f"{target}: the output path is a regular file"):
        convert("megatron", src, target)
    with pytest.raises(ConfigError, match="cannot create the output directory"):
        convert("megatron", src, target / "below")
    with pytest.raises(ConfigError, match=f"{target}: the output path is a regular file"):
        ShardWriter(str(target))
    assert main(["convert", "--from", "megatron", "--input", str(src), "--output", str(target)]) == 2
    assert f"{target}: the output path is a regular file" in capsys.readouterr().err
    assert target.read_bytes() == b"not a directory"


def test_text_output_path_that_is_a_regular_file_is_named(tmp_path):
    pytest.importorskip("tokenizers")
    from helpers.text import train_hf, write_text_jsonl

    docs = ["one two three", "four five"] * 20
    src = write_text_jsonl(tmp_path / "docs.jsonl", docs)
    tok = train_hf(tmp_path / "tokenizer.json", docs)
    target = tmp_path / "taken"
    target.write_bytes(b"x")
    with pytest.raises(ConfigError, match=f"{target}: the output path is a regular file"):
        convert("jsonl", src, target, text_field="text", tokenizer=tok, progress=False)


def test_megatron_bin_longer_than_its_index_warns(tmp_path, rng):
    docs = random_docs(rng, 30, zero_frac=0)
    prefix = write_megatron(tmp_path / "c", docs)
    indexed = os.path.getsize(f"{prefix}.bin")
    with open(f"{prefix}.bin", "ab") as f:
        f.write(np.arange(10, dtype=np.uint16).tobytes())
    pattern = (f"{prefix}.bin: {indexed + 20} bytes, but {prefix}.idx indexes only {indexed} "
               r"\(20 bytes after the last sequence")
    with pytest.warns(UserWarning, match=pattern):
        convert("megatron", prefix, tmp_path / "s")
    _, records = read_stream(str(tmp_path / "s"))
    assert _same(records, docs)


def test_an_exact_bin_does_not_warn(tmp_path, rng, recwarn):
    prefix = write_megatron(tmp_path / "c", random_docs(rng, 30))
    convert("megatron", prefix, tmp_path / "s")
    assert not [w for w in recwarn if "indexes only" in str(w.message)]


def test_verify_names_a_zero_byte_shard(tmp_path, rng, capsys):
    src = write_megatron(tmp_path / "c", random_docs(rng, 300, max_len=500))
    manifest = convert("megatron", src, tmp_path / "s", shard_size="16KiB")
    info = manifest.shards[manifest.num_shards // 2]
    (tmp_path / "s" / info.name).write_bytes(b"")
    assert f"{info.name}: size 0 bytes, manifest says {info.bytes}" in verify_stream(str(tmp_path / "s"))
    assert main(["verify", str(tmp_path / "s")]) == 1
    assert f"{info.name}: size 0 bytes" in capsys.readouterr().err
