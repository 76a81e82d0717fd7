"""What storage opens, whatever a manifest says: only regular files locally (a FIFO or
/dev/zero is refused, not waited on or read forever), never a path outside the cache directory,
never a key outside the bucket on S3; a cache directory that cannot be made is warned about
once and read around; a range past a local file's end fails at once."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from helpers.storage import config, make_docs, read_all, same, tokens_of, write_corpus
from streamforge.errors import ConfigError, ShardCorruptError
from streamforge.source import ShardSource
from streamforge.storage.cache import FrameCache
from streamforge.storage.config import RetryPolicy
from streamforge.storage.fetch import ByteFetcher
from streamforge.storage.local import LOCAL_READER
from streamforge.storage.open import open_url


@pytest.fixture
def local(tmp_path):
    docs = make_docs(count=120)
    url = str(tmp_path / "web")
    return url, docs, write_corpus(url, docs)


def _in_thread(fn, timeout=30.0):
    """``fn()``'s exception (or None), failing the test if it has not returned in ``timeout``."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["exc"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still blocked after {timeout} s"
    return out.get("exc")


def test_a_fifo_where_a_shard_should_be_is_refused_not_waited_on(local):
    url, _, manifest = local
    path = f"{url}/{manifest.shard_names[1]}"
    os.unlink(path)
    os.mkfifo(path)
    exc = _in_thread(lambda: ShardSource.open(url, None, config()).read(1, 0, 1))
    assert isinstance(exc, ShardCorruptError), exc
    assert f"{manifest.shard_names[1]}: is a FIFO, not a regular file" in str(exc)


def test_dev_zero_where_a_shard_should_be_is_refused(local):
    url, _, manifest = local
    path = f"{url}/{manifest.shard_names[0]}"
    os.unlink(path)
    os.symlink("/dev/zero", path)
    with pytest.raises(ShardCorruptError, match=r"is a character device, not a regular file"):
        ShardSource.open(url, None, config()).read(0, 0, 1)


def test_a_missing_shard_is_named(local):
    url, _, manifest = local
    os.unlink(f"{url}/{manifest.shard_names[2]}")
    with pytest.raises(ShardCorruptError, match=rf"{manifest.shard_names[2]} index: the manifest lists this shard, but it is not there"):
        ShardSource.open(url, None, config()).read(2, 0, 1)


def test_a_range_past_a_local_files_end_fails_at_once(local):
    """Was 15 s of retries before "giving up": a local short read is not transient."""
    url, _, manifest = local
    name, size = manifest.shard_names[0], int(manifest.columns["bytes"][0])
    fetcher = ByteFetcher(url, retry=RetryPolicy())  # the default policy: seconds of retries
    start = time.perf_counter()
    with pytest.raises(ShardCorruptError, match=rf"{name}: asked for bytes {size - 10}..{size + 10}, the file holds 10"):
        fetcher.read(name, size - 10, size + 10)
    with pytest.raises(ShardCorruptError, match=rf"bytes {size - 10}..{size + 10} are not a range of a {size}-byte shard"):
        fetcher.read(name, size - 10, size + 10, file_size=size)
    with pytest.raises(ShardCorruptError, match=r"bytes -1..10 are not a range"):
        fetcher.read(name, -1, 10)
    assert time.perf_counter() - start < 5 and fetcher.retries == 0
    with pytest.raises(ValueError, match=r"bytes -1..10 are not a range of a file"):
        LOCAL_READER.cat_file(f"{url}/{name}", -1, 10)


def test_cache_file_names_never_come_from_the_manifest(tmp_path):
    root = tmp_path / "cache"
    cache = FrameCache(str(root), "0" * 32)
    for name in ("../../../outside", "/etc/evil", "a/../../b", "shard-000000.tar.zst"):
        cache.put(name, 3, b"frame")
        path = os.path.realpath(cache.path(name, 3))
        assert os.path.commonpath([str(root), path]) == str(root), path
        assert name.strip("/") not in path
        assert cache.get(name, 3, 5) == b"frame"
    assert not (tmp_path / "outside").exists()
    hostile = FrameCache(str(root), "../../escape")
    assert os.path.commonpath([str(root), os.path.realpath(hostile.dir)]) == str(root)


def test_an_uncreatable_cache_dir_is_warned_about_once_and_read_around(local, tmp_path, caplog):
    url, docs, _ = local
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"a regular file where the cache directory should be")
    caplog.set_level(logging.WARNING, logger="streamforge.storage")
    source = ShardSource.open(url, None, config(cache_dir=str(blocker / "cache"), cache_limit=1 << 20))
    assert same(tokens_of(read_all(source)), docs)
    warnings = [r for r in caplog.records if "cannot be used" in r.getMessage()]
    assert len(warnings) == 1 and "reading without it" in warnings[0].getMessage()
    assert source.stats()["cache_hits"] == 0


def test_the_signed_http_client_never_leaves_the_bucket(s3_server):
    """Defense in depth behind the manifest check: ``../../other-bucket/key`` used to be sent
    as ``GET /other-bucket/key``, and a server without authentication served it."""
    opts = s3_server.storage_options()
    bucket, other = s3_server.new_bucket(), s3_server.new_bucket("other")
    fs, _ = open_url(f"s3://{other}", opts)
    fs.pipe(f"{other}/secret", b"another bucket's object")
    reader, _ = open_url(f"s3://{bucket}/web", opts, RetryPolicy(), "http")
    assert reader.cat_file(f"{other}/secret") == b"another bucket's object"  # addressed directly: fine
    for path in (f"{bucket}/web/../../{other}/secret", f"{bucket}/../{other}/secret", f"../{other}/secret",
                 f"{bucket}/./web/x"):
        with pytest.raises(ConfigError, match=r"key with a '\.' or '\.\.' segment"):
            reader.cat_file(path, 0, 5)
        with pytest.raises(ConfigError):
            reader.cat_file(path)


def test_sound_reads_are_unchanged_with_the_checks(local):
    url, docs, _ = local
    assert same(tokens_of(read_all(ShardSource.open(url, None, config()))), docs)
    assert LOCAL_READER.cat_file(f"{url}/index.json", 0, 1) == b"{"
