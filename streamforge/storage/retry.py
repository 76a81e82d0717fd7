"""Retrying transient storage faults with exponential backoff and jitter.

``is_transient`` sorts an exception from fsspec/s3fs/gcsfs/botocore/aiohttp into "try again"
(connection reset, timeout, HTTP 5xx, 503 SlowDown, 429/408, short read) or "will not get
better" (missing object or bucket, denied, bad request, corrupt data). ``with_retries`` runs
one request until it succeeds, raises a permanent error at once, or gives up after
``RetryPolicy.attempts`` tries with a ``StorageError`` that names what was being read.

A throttling answer (``503 SlowDown``, ``429``: ``is_throttle``) is retried apart from the
attempts, with decorrelated jitter, for at most ``RetryPolicy.throttle_wait`` seconds of
waiting per request (``RetryPolicy.throttle_delay``); the error that ends it names the object,
the time waited and what the store said.
"""

from __future__ import annotations

import errno
import logging
import random
import threading
import time
from typing import Callable, TypeVar

from ..errors import ConfigError, ManifestError, ShardCorruptError, StorageError
from .config import RetryPolicy

log = logging.getLogger("streamforge.storage")
T = TypeVar("T")

_PERMANENT_TYPES = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ShardCorruptError,
    ManifestError,
    ConfigError,
)
_PERMANENT_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENOTDIR}
_TRANSIENT_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http", "ssl")
# Client-library errors that no retry can fix: credentials and configuration.
_PERMANENT_NAMES = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "NoRegionError",
    "ParamValidationError",
    "InvalidConfigError",
    "DefaultCredentialsError",
    "RefreshError",
}


class ShortRead(OSError):
    """A ranged read returned fewer bytes than asked for (a body cut off in transit)."""


def http_status(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc`` or its causes, when a client library recorded one."""
    seen = 0
    while exc is not None and seen < 8:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                return int(status)
        # aiohttp's ClientResponseError.status, gcsfs's HttpError.code. (Not every ``code``:
        # aiohttp's payload errors carry a parser code of 400 for a body cut off in transit.)
        name = type(exc).__name__
        attr = "status" if name.endswith("ResponseError") else "code" if name == "HttpError" else None
        value = getattr(exc, attr, None) if attr else None
        if isinstance(value, int) and 100 <= value < 600:
            return value
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def is_credentials_error(exc: BaseException) -> bool:
    """True for a client library's "no/partial/unusable credentials" error."""
    return type(exc).__name__ in _PERMANENT_NAMES and "Credential" in type(exc).__name__ or (
        type(exc).__name__ == "RefreshError"
    )


def is_transient(exc: BaseException) -> bool:
    """True when trying the same request again may succeed."""
    if isinstance(exc, ShortRead):
        return True
    if isinstance(exc, _PERMANENT_TYPES) or type(exc).__name__ in _PERMANENT_NAMES:
        return False
    status = http_status(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNOS
    module = type(exc).__module__.split(".")[0]
    return module in _TRANSIENT_MODULES or "Timeout" in type(exc).__name__


_THROTTLE_WORDS = ("SlowDown", "Slow Down", "TooManyRequests", "RequestLimitExceeded", "Throttl")


def is_throttle(exc: BaseException) -> bool:
    """True when the store answered that the request rate is too high: HTTP 503 or 429, or
    an error that says SlowDown / throttling."""
    status = http_status(exc)
    if status in (429, 503):
        return True
    seen = 0
    while exc is not None and seen < 8:
        text = f"{type(exc).__name__} {exc}"
        if any(w in text for w in _THROTTLE_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class Retrier:
    """Runs requests under a ``RetryPolicy``; counts retries. Picklable (no live state)."""

    def __init__(self, policy: RetryPolicy, sleep: Callable[[float], None] = time.sleep) -> None:
        self.policy = policy
        self.retries = 0
        self.throttled = 0  # retries after a throttling answer
        self._sleep = sleep
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"policy": self.policy, "retries": 0, "throttled": 0, "_sleep": self._sleep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __call__(self, request: Callable[[], T], what: str, settled: threading.Event | None = None) -> T:
        """``request()`` until it succeeds; ``what`` names the url/shard/frame for errors.
        Once ``settled`` is set (a hedged twin answered), a failed attempt is not retried."""
        policy = self.policy
        failed = throttled = 0
        waited = previous = 0.0
        while True:
            try:
                return request()
            except Exception as exc:  # noqa: BLE001 - sorted just below, re-raised if permanent
                if not is_transient(exc) or (settled is not None and settled.is_set()):
                    raise
                throttle = policy.throttle_wait > 0 and is_throttle(exc)
                if throttle:
                    throttled += 1
                    if waited >= policy.throttle_wait:
                        raise StorageError(
                            f"{what}: the object store kept throttling the request ({throttled} answers saying "
                            f"so over {waited:.1f} s of backing off, RetryPolicy.throttle_wait={policy.throttle_wait:g} "
                            f"s); last answer: {type(exc).__name__}: {exc}. The request rate on this prefix is "
                            "above what the store allows: larger fetch units (fewer requests) or shards spread "
                            "over more prefixes lower it (docs/storage.md)"
                        ) from exc
                    delay = min(policy.throttle_delay(previous, random.random()), policy.throttle_wait - waited)
                    previous, waited = delay, waited + delay
                    tries = f"throttled {throttled}x, {waited:.2f}/{policy.throttle_wait:g} s"
                else:
                    failed += 1
                    if failed >= policy.attempts:
                        raise StorageError(
                            f"{what}: giving up after {policy.attempts} attempts; last error: "
                            f"{type(exc).__name__}: {exc}"
                        ) from exc
                    delay = policy.delay(failed, random.random())
                    tries = f"attempt {failed}/{policy.attempts}"
                with self._lock:
                    self.retries += 1
                    self.throttled += throttle
                log.info("%s: %s failed (%s: %s); retrying in %.3fs", what, tries, type(exc).__name__, exc, delay)
                self._sleep(delay)
