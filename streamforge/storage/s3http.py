"""S3 reads as plain HTTP requests, signed by botocore's SigV4 signer and sent over urllib3.

A reader asks S3 three things: a byte range of an object (a GET with ``Range``), an object's
size (a HEAD), and whether a bucket exists (a HEAD on the bucket). ``S3HttpReader`` makes
those requests with two libraries s3fs already installs, botocore's ``S3SigV4Auth`` to sign
and urllib3's connection pool to send, and with nothing else: no service model, no session,
no event loop or thread of its own. It is ready at once, and it survives ``fork``: the pool
belongs to the process that made it, and a forked process makes its own.

That is what a DataLoader worker forked from a trainer needs. obstore cannot run there once
the trainer has used it (its runtime's threads do not survive the fork, objstore.py), and
s3fs's first request there builds a botocore client before the first byte. In such a worker
this reader costs less CPU than s3fs for the first request and for each after it, and about
as much as obstore in a process of its own (docs/storage.md, "The S3 client", has the figures).

It takes obstore's settings (``objstore.obstore_settings``): credentials stated or ``anon``,
and a region or an endpoint; options it cannot honour leave the stream to s3fs. It answers
each request once: streamforge's retry policy (storage/retry.py) retries. It never sends a
key with a ``.`` or ``..`` segment (``ConfigError``): urllib3 and servers resolve them, and
``bucket/web/../../other/key`` would be ``GET /other/key``, another bucket's object.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import urllib.request
from typing import Any
from urllib.parse import quote, urlsplit

import urllib3
from botocore.awsrequest import AWSRequest

from ..errors import ConfigError
from .config import RetryPolicy
from .objstore import error_for_status, s3_path

_XML_FIELD = re.compile(r"<(Code|Message)>([^<]*)</\1>")
_BUCKET = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")  # S3's names, legacy ones too; never ".."


class S3HttpReader:
    """The part of an fsspec filesystem that streamforge's readers use (``cat_file`` whole or
    a byte range, ``size``, ``exists``), as signed HTTP requests (module docstring)."""

    protocol = "s3"
    client = "http"  # counted apart in ``stats()["http_requests"]``

    def __init__(self, config: dict[str, Any], policy: RetryPolicy) -> None:
        self._config = dict(config)
        self._timeout = policy.timeout
        self._pools: dict[str | None, Any] = {}  # by proxy (None: direct), this process's
        self._routes: dict[tuple[str, str], str | None] = {}  # (scheme, host) -> its proxy
        self._pool_pid: int | None = None
        self._signer: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"_config": self._config, "_timeout": self._timeout}  # pools are per process

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["_config"], RetryPolicy(timeout=state["_timeout"]))

    _strip_protocol = staticmethod(s3_path)

    # -- requests ----------------------------------------------------------------------------
    def _http(self, url: str):
        """This process's connection pool for ``url`` (a forked process builds its own): direct,
        or through the proxy the environment names for it (``HTTPS_PROXY``, ``HTTP_PROXY``,
        ``NO_PROXY``, as botocore reads them). TLS is checked against ``AWS_CA_BUNDLE`` or
        botocore's CA bundle."""
        pid = os.getpid()
        if self._pool_pid != pid:
            with self._lock:
                if self._pool_pid != pid:
                    self._signer = self._make_signer()
                    self._pools, self._routes = {}, {}
                    self._pool_pid = pid  # last: other threads check it without the lock
        parts = urlsplit(url)
        route = (parts.scheme, parts.hostname or "")
        proxy = self._routes.get(route, False)
        if proxy is False:
            found = urllib.request.getproxies().get(parts.scheme)
            proxy = self._routes[route] = None if not found or urllib.request.proxy_bypass(route[1]) else found
        pool = self._pools.get(proxy)
        if pool is None:
            with self._lock:
                pool = self._pools.get(proxy)
                if pool is None:
                    pool = self._pools[proxy] = self._make_pool(proxy)
        return pool

    def _make_pool(self, proxy: str | None):
        from botocore.httpsession import get_cert_path

        settings = {"num_pools": 8, "maxsize": 16, "retries": False,
                    "timeout": urllib3.Timeout(connect=self._timeout, read=self._timeout),
                    "ca_certs": os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True)}
        return urllib3.ProxyManager(proxy, **settings) if proxy else urllib3.PoolManager(**settings)

    def _make_signer(self):
        config = self._config
        if config.get("skip_signature"):
            return None
        from botocore.auth import S3SigV4Auth
        from botocore.credentials import Credentials

        credentials = Credentials(config["access_key_id"], config["secret_access_key"], config.get("session_token"))
        return S3SigV4Auth(credentials, "s3", config["region"])

    def url(self, bucket: str, key: str = "") -> str:
        """The HTTP address of ``key`` in ``bucket`` (of the bucket itself when ``key`` is
        empty): path style under an endpoint, virtual-hosted on AWS where the settings ask
        for it and the name is a valid host name (a dotted one is not, under TLS)."""
        config = self._config
        if not _BUCKET.fullmatch(bucket) or any(part in (".", "..") for part in key.split("/")):
            # a "." or ".." segment is resolved by urllib3 or the server ("b/web/../../other/k"
            # becomes "GET /other/k"): a key must never reach another bucket, whatever a
            # manifest or a URL says
            raise ConfigError(
                f"s3://{bucket}/{key}: refusing a request for a bucket name S3 does not allow, or "
                "for a key with a '.' or '..' segment, which could address another bucket"
            )
        path = "/" + quote(key, safe="/~") if key else ""
        endpoint = config.get("endpoint")
        if endpoint:
            return f"{endpoint.rstrip('/')}/{bucket}{path}"
        region = config["region"]
        if config.get("virtual_hosted_style_request") and "." not in bucket:
            return f"https://{bucket}.s3.{region}.amazonaws.com{path or '/'}"
        return f"https://s3.{region}.amazonaws.com/{bucket}{path}"

    def _request(self, method: str, path: str, headers: dict[str, str] | None = None):
        """One answered request, or the builtin error streamforge's retry sorts (a 404 is a
        ``FileNotFoundError``, a 403 a ``PermissionError``, no answer a ``ConnectionError``)."""
        bucket, _, key = self._strip_protocol(path).partition("/")
        url = self.url(bucket, key)
        pool = self._http(url)
        where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
        headers = dict(headers or {})
        if self._signer is not None:
            request = AWSRequest(method=method, url=url, headers=headers)
            self._signer.add_auth(request)
            headers = dict(request.headers.items())
        try:
            response = pool.request(method, url, headers=headers, redirect=False, preload_content=True)
        except urllib3.exceptions.HTTPError as exc:
            # urllib3 files a refused connection under its timeouts too
            refused = isinstance(exc, urllib3.exceptions.NewConnectionError)
            if isinstance(exc, urllib3.exceptions.TimeoutError) and not refused:
                raise TimeoutError(errno.ETIMEDOUT, f"{where}: {exc}") from exc
            raise ConnectionError(errno.ECONNRESET, f"{where}: {exc}") from exc  # refused, reset, cut off
        if response.status >= 300:
            fields = dict(_XML_FIELD.findall(response.data[:4096].decode("utf-8", "replace")))
            said = ": ".join(v for v in (fields.get("Code"), fields.get("Message")) if v)
            raise error_for_status(response.status, f"{where}: HTTP {response.status}" + (f" {said}" if said else ""))
        return response

    # -- the reader interface ----------------------------------------------------------------
    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or bytes ``[start, end)`` of it."""
        if start is None and end is None:
            return self._request("GET", path).data
        if start is None or end is None:
            raise ValueError("cat_file takes both start and end, or neither")
        if end <= start:
            return b""
        response = self._request("GET", path, {"Range": f"bytes={start}-{end - 1}"})
        data = response.data
        if response.status == 200:  # a server that ignored the range sent the whole object
            data = data[start:end]
        return data

    def size(self, path: str) -> int:
        return int(self._request("HEAD", path).headers["Content-Length"])

    def exists(self, path: str) -> bool:
        """Whether the object (or, for a bare bucket name, the bucket) exists."""
        try:
            self._request("HEAD", path)
        except FileNotFoundError:
            return False
        return True
