"""S3 reads through obstore, when it is installed and the stream's options allow it.

obstore's client is built in Rust: it is ready at once and answers a ranged GET in one round
trip, where s3fs first builds a botocore client (service models, a session, an event loop
thread) before the first byte of a stream and asks for an object's size before reading it
whole: most of the time to a first batch from S3 (docs/storage.md, "What a read costs").

Only reads go this way: the manifest, shard indexes and frames. Writers, the ledger and
conversion keep the protocol's fsspec filesystem. ``StorageConfig.client`` picks:

- ``"auto"`` (the default): obstore for ``s3://`` when it is installed and the options say
  everything it needs (``obstore_settings``); where they do not, fsspec, and the reason is
  logged;
- ``"obstore"``: obstore, or a ``ConfigError`` that says why it cannot be used;
- ``"http"``: signed HTTP requests over urllib3 (``s3http.py``), with the same settings;
- ``"fsspec"``: always the protocol's fsspec filesystem (s3fs).

obstore's runtime does not survive ``fork``: a process forked from one whose obstore client had
already made requests would hang on its first one. Such a process (a DataLoader worker started
with ``fork``) reads through ``s3http`` instead, under ``"auto"`` and ``"obstore"`` alike, and so
does ``"auto"`` where obstore is not installed; workers started with ``spawn`` or
``forkserver`` use obstore.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from datetime import timedelta
from typing import Any

from ..errors import ConfigError
from .config import RetryPolicy
from .urls import without_scheme

# s3fs options that change nothing about how one object is read
_HARMLESS = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
             "default_block_size", "default_fill_cache", "default_cache_type", "cache_regions"}
_CLIENT_KWARGS = {"endpoint_url", "region_name"}
# what open.client_defaults puts in config_kwargs: streamforge's own retry and timeouts
_OWN_CONFIG = {"retries", "connect_timeout", "read_timeout"}

_RUNTIME_PID: int | None = None  # the process whose obstore runtime has made requests
_PID_LOCK = threading.Lock()


def _note_requests() -> None:
    global _RUNTIME_PID
    if _RUNTIME_PID is None:
        with _PID_LOCK:
            if _RUNTIME_PID is None:
                _RUNTIME_PID = os.getpid()


def forked_after_use() -> bool:
    """True in a process forked from one whose obstore runtime had made requests."""
    return _RUNTIME_PID is not None and _RUNTIME_PID != os.getpid()


def _env(*names: str) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def obstore_settings(options: dict[str, Any]) -> tuple[dict, str | None]:
    """``(S3 config, None)`` for s3fs-style ``options`` obstore can honour, else ``({}, why)``.

    Credentials must be stated (``key``/``secret``/``token`` or ``anon``, or the
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` variables): profiles, instance roles and
    other parts of botocore's credential chain are left to s3fs. So is a bucket of unknown
    region on AWS itself, which botocore finds and obstore does not: a region must be given
    (``client_kwargs={"region_name": ...}`` or ``AWS_REGION``), or an endpoint.
    """
    unknown = sorted(set(options) - _HARMLESS - {"key", "secret", "token", "anon", "endpoint_url",
                                                  "client_kwargs", "config_kwargs"})
    if unknown:
        return {}, f"storage_options {unknown} have no obstore counterpart"
    client_kwargs = options.get("client_kwargs") or {}
    extra = sorted(set(client_kwargs) - _CLIENT_KWARGS)
    if extra:
        return {}, f"client_kwargs {extra} have no obstore counterpart"
    extra = sorted(set(options.get("config_kwargs") or {}) - _OWN_CONFIG)
    if extra:
        return {}, f"config_kwargs {extra} have no obstore counterpart"
    config: dict[str, Any] = {}
    if options.get("anon"):
        config["skip_signature"] = True
    else:
        key = options.get("key") or _env("AWS_ACCESS_KEY_ID")
        secret = options.get("secret") or _env("AWS_SECRET_ACCESS_KEY")
        if not (key and secret):
            return {}, "no key and secret in storage_options or the environment (s3fs reads the AWS profile chain)"
        config["access_key_id"], config["secret_access_key"] = key, secret
        token = options.get("token") or (None if options.get("key") else _env("AWS_SESSION_TOKEN"))
        if token:
            config["session_token"] = token
    endpoint = (client_kwargs.get("endpoint_url") or options.get("endpoint_url")
                or _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))
    region = client_kwargs.get("region_name") or _env("AWS_REGION", "AWS_DEFAULT_REGION")
    if endpoint:
        config["endpoint"] = endpoint
        config["region"] = region or "us-east-1"
    elif region:
        config["region"] = region
        config["virtual_hosted_style_request"] = True
    else:
        return {}, "no region and no endpoint (s3fs asks AWS where the bucket is)"
    return config, None


def blocked() -> str | None:
    """Why obstore cannot run in this process (not installed, or forked after use), or None."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        return "obstore is not installed (pip install 'streamforge[obstore]')"
    if forked_after_use():
        return "this process was forked after obstore had made requests in its parent"
    return None


class S3ResponseError(OSError):
    """An S3 answer with an HTTP status (``status``), sorted by ``retry.is_transient``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(errno.EIO, message)
        self.status = status


def s3_path(url: str) -> str:
    """``bucket/key`` of an ``s3://`` (or ``s3a://``) URL: the path an S3 reader is given."""
    return without_scheme(url, "s3", "s3a").rstrip("/")


def error_for_status(status: int, text: str) -> OSError:
    """The builtin error streamforge's retry and error messages sort, for an S3 answer of
    HTTP ``status`` (obstore's and ``s3http``'s alike)."""
    if status == 416:  # a range past the end: fetch.py checks the object's size
        return OSError(errno.EINVAL, text)
    if status == 404:
        return FileNotFoundError(errno.ENOENT, text)
    if status in (401, 403):
        return PermissionError(errno.EACCES, text)
    return S3ResponseError(status, text)


_STATUS = re.compile(r"status code: (\d{3})")


def _translate(exc: BaseException, where: str) -> BaseException:
    """obstore's error as the builtin streamforge's retry and error messages sort."""
    from obstore import exceptions as ox

    said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = f"{where}: {said[:300]}"  # obstore quotes the server's whole XML answer
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, text)
    if isinstance(exc, (ox.PermissionDeniedError, ox.UnauthenticatedError)):
        return PermissionError(errno.EACCES, text)
    found = _STATUS.search(str(exc))
    if found:
        return error_for_status(int(found.group(1)), text)
    if isinstance(exc, ox.GenericError):  # no answer: refused, reset or timed out
        return ConnectionError(errno.ECONNRESET, text)
    return ConfigError(text)


class ObstoreReader:
    """The part of an fsspec filesystem that streamforge's readers use, on obstore's S3 client:
    ``cat_file`` (whole or a byte range), ``size``, ``exists``. One store per bucket."""

    protocol = "s3"
    client = "obstore"  # counted apart in ``stats()["obstore_requests"]``

    def __init__(self, config: dict[str, Any], policy: RetryPolicy) -> None:
        self._config = config
        timeout = timedelta(seconds=policy.timeout)
        self._client = {"timeout": timeout, "connect_timeout": timeout,
                        "allow_http": str(config.get("endpoint", "")).startswith("http://")}
        # streamforge retries (storage/retry.py): obstore answers each request once
        self._retry = {"max_retries": 0, "retry_timeout": timeout}
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    _strip_protocol = staticmethod(s3_path)

    def _split(self, path: str) -> tuple[Any, str]:
        bucket, _, key = self._strip_protocol(path).partition("/")
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                from obstore.store import S3Store

                config = self._config
                if "." in bucket and config.get("virtual_hosted_style_request"):
                    # a dotted name is no valid TLS host name under s3.amazonaws.com
                    config = {**config, "virtual_hosted_style_request": False}
                store = S3Store(bucket, config=config, client_options=self._client,
                                retry_config=self._retry)
                self._stores[bucket] = store
        return store, key

    def _call(self, path: str, fn):
        import obstore

        store, key = self._split(path)
        _note_requests()
        try:
            return fn(obstore, store, key)
        except Exception as exc:  # noqa: BLE001 - translated just below, or re-raised as is
            if type(exc).__module__.split(".")[0] != "obstore" and not isinstance(exc, FileNotFoundError):
                raise
            raise _translate(exc, f"s3://{self._strip_protocol(path)}") from exc

    def cat_file(self, path: str, start: int | None = None, end: int | None = None):
        """The object's bytes, or bytes ``[start, end)`` of it without a copy (a memoryview)."""
        if start is None and end is None:
            return self._call(path, lambda ob, store, key: ob.get(store, key).bytes().to_bytes())
        if start is None or end is None:
            raise ValueError("cat_file takes both start and end, or neither")
        return self._call(path, lambda ob, store, key: memoryview(ob.get_range(store, key, start=start, end=end)))

    def size(self, path: str) -> int:
        return int(self._call(path, lambda ob, store, key: ob.head(store, key)["size"]))

    def exists(self, path: str) -> bool:
        """Whether the object (or, for a bare bucket name, the bucket) exists."""
        store, key = self._split(path)
        try:
            if key:
                self.size(path)
            else:
                self._call(path, lambda ob, s, k: next(iter(ob.list(s, chunk_size=1)), None))
        except FileNotFoundError:
            return False
        return True
