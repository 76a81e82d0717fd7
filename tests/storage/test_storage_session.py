"""S3 filesystems of one process share botocore's data loader, and a forked worker inherits it
with what it cached: a second S3 client costs milliseconds instead of a re-read and re-parse
of the service model (real S3 server on 127.0.0.1)."""

from __future__ import annotations

import multiprocessing as mp

from streamforge.storage import open as storage_open
from streamforge.storage.config import RetryPolicy


def _loader(fs):
    return fs.session.get_component("data_loader")


def _options(s3_server, tag: str) -> dict:
    # distinct options: distinct filesystems, each with its own session and client
    options = s3_server.storage_options()
    options["config_kwargs"] = {"user_agent_extra": tag}
    return options


def _child(endpoint_fs_options, bucket, queue) -> None:
    fs, path = storage_open.open_url(f"s3://{bucket}/x", endpoint_fs_options, RetryPolicy())
    inherited = storage_open._BOTOCORE_LOADER
    cached_before = len(getattr(inherited, "_cache", {}))
    fs.ls(bucket)
    queue.put((inherited is _loader(fs), cached_before))


def test_s3_filesystems_share_one_service_data_loader(s3_server):
    bucket = s3_server.new_bucket()
    first, _ = storage_open.open_url(f"s3://{bucket}/a", _options(s3_server, "first"), RetryPolicy())
    second, _ = storage_open.open_url(f"s3://{bucket}/b", _options(s3_server, "second"), RetryPolicy())
    assert first is not second and first.session is not second.session
    first.ls(bucket)
    second.ls(bucket)
    assert _loader(first) is _loader(second) is storage_open._BOTOCORE_LOADER
    assert storage_open._BOTOCORE_LOADER._cache  # the service model, read once

    # a forked worker builds its client from the models the parent read
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(_options(s3_server, "child"), bucket, queue))
    proc.start()
    shared, cached_before = queue.get(timeout=60)
    proc.join(60)
    assert proc.exitcode == 0
    assert shared and cached_before > 0


def test_a_given_session_is_left_alone(s3_server):
    from aiobotocore.session import AioSession

    bucket = s3_server.new_bucket()
    own = AioSession()
    options = {**_options(s3_server, "own"), "session": own}
    fs, _ = storage_open.open_url(f"s3://{bucket}/c", options, RetryPolicy())
    fs.ls(bucket)
    assert fs.session is own
