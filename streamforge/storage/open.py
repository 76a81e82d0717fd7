"""Resolve any fsspec URL (local path, file://, s3://, gs://...) to a filesystem and a path.

For object stores streamforge owns retries (``storage/retry.py``), so it asks the client
library not to retry on its own and to time out after ``RetryPolicy.timeout``: every retry
is then counted and backed off the same way whatever the backend. Options the caller passes
in ``storage_options`` always win over these defaults.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
from typing import Any

from ..errors import ConfigError
from .config import CLIENTS, RetryPolicy
from .urls import join, without_scheme  # noqa: F401 - re-exported: callers import them from here

log = logging.getLogger("streamforge.storage")


def protocol_of(url: str) -> str:
    text = str(url)
    if "://" not in text and "::" not in text:
        return "file"  # a plain path: no fsspec import for it
    import fsspec.core

    protocol = fsspec.core.split_protocol(text)[0] or "file"
    return {"s3a": "s3", "gcs": "gs", "local": "file"}.get(protocol, protocol)


LOCAL_PROTOCOLS = ("file", "local", "memory")


def is_local(url: str) -> bool:
    """True for paths on this machine's file systems (and fsspec's in-memory one): a read
    costs microseconds, not a network round trip."""
    return protocol_of(url) in LOCAL_PROTOCOLS


def client_defaults(url: str, policy: RetryPolicy | None) -> dict[str, Any]:
    """storage_options defaults that hand retries and timeouts to streamforge."""
    if policy is None:
        return {}
    protocol = protocol_of(url)
    if protocol == "s3":
        return {
            "config_kwargs": {
                "retries": {"total_max_attempts": 1},
                "connect_timeout": policy.timeout,
                "read_timeout": policy.timeout,
            },
        }
    if protocol == "gs":
        return {"timeout": policy.timeout}
    return {}


def _merged(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(defaults)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


_FILESYSTEMS: dict[tuple, Any] = {}
_FILESYSTEMS_LOCK = threading.Lock()


def open_url(url: str, storage_options: dict[str, Any] | None = None, policy: RetryPolicy | None = None,
             client: str = "fsspec"):
    """``(filesystem, path)`` for ``url``; ``storage_options`` go to the filesystem.

    ``client`` (``StorageConfig.client``) is given by readers, which need no more than
    ``cat_file``, ``size`` and ``exists``: any value but ``"fsspec"`` reads local files with
    ``open`` (storage/local.py, no fsspec import), and ``s3://`` through obstore or signed
    HTTP requests where the options allow (storage/objstore.py, storage/s3http.py). fsspec
    is imported on the first URL that needs it.

    With ``policy``, object-store clients get streamforge's retry and timeout defaults. One
    filesystem is made per process for each protocol and set of options, and shared by the
    manifest, the index and the frame reads of every stream using them: building an S3 or GCS
    client (service models, a session, a first connection) is a large part of the time to
    a first batch, which would otherwise be paid once per reader (docs/storage.md).
    ``skip_instance_cache`` keeps its meaning for fsspec's own cache; this one lives in
    streamforge, per process.
    """
    given = dict(storage_options or {})
    protocol = protocol_of(url)
    direct = client != "fsspec" and "::" not in str(url)  # a reader, and no chained URL
    if direct and protocol == "file":
        from .local import LOCAL_READER

        return LOCAL_READER, LOCAL_READER._strip_protocol(url)
    if direct and protocol == "s3":
        reader = _s3_reader(url, given, policy or RetryPolicy(), client)
        if reader is not None:
            return reader, reader._strip_protocol(url)
    options = _merged(client_defaults(url, policy), given)
    try:
        key = (os.getpid(), protocol, json.dumps(options, sort_keys=True), policy is not None)
    except TypeError:  # options that are not plain data (a session object...): no sharing
        key = None
    if "::" in str(url):  # a chained URL (simplecache::s3://...): fsspec resolves it each time
        key = None
    if key is not None:
        with _FILESYSTEMS_LOCK:
            fs = _FILESYSTEMS.get(key)
        if fs is not None:
            return fs, fs._strip_protocol(str(url))
    import fsspec.core

    fs, path = fsspec.core.url_to_fs(str(url), **options)
    if protocol == "s3":
        _share_service_data(fs)
    if policy is not None and protocol == "s3" and "retries" not in given:
        # s3fs's own retry loop is a class attribute, not a constructor option; this
        # instance is keyed by the options above, so only streamforge readers share it.
        fs.retries = 1
    if key is not None:
        with _FILESYSTEMS_LOCK:
            fs = _FILESYSTEMS.setdefault(key, fs)
    return fs, path


def _s3_reader(url: str, given: dict[str, Any], policy: RetryPolicy, client: str):
    """The process's direct S3 reader for these options (obstore's, or ``s3http``'s where
    obstore cannot run here), or None where s3fs must read (and ``client="auto"``); a
    ``client`` that cannot be honoured is a ``ConfigError`` that says why."""
    from . import objstore

    if client not in CLIENTS:
        raise ConfigError(f"StorageConfig.client must be one of {CLIENTS}, got {client!r}")
    settings, why = objstore.obstore_settings(given)
    if why is not None:
        if client == "auto":
            log.debug("%s: reading through s3fs: %s", url, why)
            return None
        raise ConfigError(f"{url}: StorageConfig.client={client!r} cannot be used: {why}")
    kind = client
    if client in ("auto", "obstore"):
        blocked = objstore.blocked()
        if blocked is not None and client == "obstore" and not objstore.forked_after_use():
            raise ConfigError(f"{url}: StorageConfig.client='obstore' cannot be used: {blocked}")
        kind = "obstore" if blocked is None else "http"
    try:
        key = (os.getpid(), kind, json.dumps(given, sort_keys=True), policy)
    except TypeError:
        key = None
    with _FILESYSTEMS_LOCK:
        reader = _FILESYSTEMS.get(key) if key is not None else None
        if reader is None:
            if kind == "obstore":
                reader = objstore.ObstoreReader(settings, policy)
            else:
                from .s3http import S3HttpReader

                reader = S3HttpReader(settings, policy)
            if key is not None:
                _FILESYSTEMS[key] = reader
    return reader


_BOTOCORE_LOADER: Any = None


def _share_service_data(fs) -> None:
    """Give a new S3 filesystem a session whose botocore data loader is this process's one.

    Building an S3 client reads and parses botocore's service model, endpoint rules and
    partitions, most of the time to a first batch from S3 (docs/storage.md, "What a read
    costs"); the loader caches them, but per session, and every filesystem makes its own
    session. With one loader per process, the second client is cheap, and so is the first one in a
    DataLoader worker forked after the trainer built its own (the loader and what it cached
    come with the fork). Only the loader is shared, a cache of read-only files: credentials,
    connections and event loops stay each session's. A filesystem given its own session, or
    session options, is left alone."""
    global _BOTOCORE_LOADER
    if getattr(fs, "session", True) is not None or getattr(fs, "_s3", None) is not None or getattr(fs, "kwargs", None):
        return
    try:
        from aiobotocore.session import AioSession
    except ImportError:  # an S3 filesystem that is not s3fs on aiobotocore
        return
    session = AioSession()
    with _FILESYSTEMS_LOCK:
        if _BOTOCORE_LOADER is None:
            _BOTOCORE_LOADER = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _BOTOCORE_LOADER)
    fs.session = session


def describe_missing(fs, path: str, url: str, what: str) -> str:
    """Why ``what`` under ``url`` is not found: a missing bucket, or a missing object.

    Called only after a read failed, so a healthy start never lists or probes the bucket.
    """
    protocol = protocol_of(url)
    if protocol in ("s3", "gs"):
        bucket = path.split("/", 1)[0]
        try:
            exists = fs.exists(bucket)
        except Exception:  # noqa: BLE001 - the probe is advisory; the original error stands
            exists = True
        if not exists:
            return f"{url}: bucket {bucket!r} does not exist (or this account cannot see it)"
    return f"{url}: no {what} (not a streamforge stream, or its conversion did not finish)"
