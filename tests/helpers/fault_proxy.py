"""A fault-injecting HTTP proxy on 127.0.0.1, placed in front of the test S3 server.

Every request is forwarded to the upstream server; a seeded draw decides, per request,
whether to pass the response through or to damage it in one of these ways:

- ``reset``: headers and half the body, then a TCP reset (``SO_LINGER`` 0).
- ``slowdown``: ``503 SlowDown`` with S3's XML error body, as S3 sends when throttling.
- ``stall``: nothing for ``stall_s`` seconds (longer than the client's timeout), then close.
- ``truncate``: the full ``Content-Length`` announced, part of the body sent, clean close.

Only methods in ``methods`` (GET by default: the reads) are faulted. The draws come from
``random.Random(seed)`` in request order, so a run is repeatable up to thread scheduling.

With ``rate=0`` it is a plain pass-through that counts: ``requests`` and ``bytes_served``
(body bytes of the GET responses sent in full), whichever process made the requests, and
keeps a ``log`` of them: ``(method, path, Range header, body bytes sent, status)``. A client
marks a moment with ``GET /__proxy__/mark`` (answered here, neither forwarded nor counted):
``marks`` holds the log's length then (what had been asked before, e.g. before a first batch).

``limit=`` (requests per second) makes it throttle like S3 does per prefix: a request of
``methods`` that finds more than ``limit`` such requests in the last second (``window_s``)
is answered ``503 SlowDown`` (counted in ``faults["slowdown"]``); the others pass.
"""

from __future__ import annotations

import collections
import http.client
import random
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("reset", "slowdown", "stall", "truncate")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultProxy:
    """``FaultProxy(upstream, rate=0.05, seed=0).start()``; ``.endpoint_url``; ``.stop()``."""

    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.05,
        seed: int = 0,
        kinds: tuple[str, ...] = KINDS,
        stall_s: float = 2.0,
        methods: tuple[str, ...] = ("GET",),
        limit: float | None = None,
        window_s: float = 1.0,
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.rate = rate
        self.kinds = tuple(kinds)
        self.stall_s = stall_s
        self.methods = methods
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.requests = 0
        self.bytes_served = 0
        self.faults = dict.fromkeys(KINDS, 0)
        self.limit = limit
        self.window_s = window_s
        self._recent: collections.deque = collections.deque()
        self.log: list[tuple[str, str, str | None, int, int]] = []
        self.marks: list[int] = []
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def draw(self, method: str) -> str | None:
        with self._lock:
            self.requests += 1
            if self.limit is not None and method in self.methods:
                now = time.monotonic()
                while self._recent and self._recent[0] <= now - self.window_s:
                    self._recent.popleft()
                if len(self._recent) >= self.limit * self.window_s:
                    self.faults["slowdown"] += 1
                    return "slowdown"
                self._recent.append(now)
            if method not in self.methods or self._rng.random() >= self.rate:
                return None
            kind = self._rng.choice(self.kinds)
            self.faults[kind] += 1
            return kind

    def served(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_served += nbytes

    def record(self, method: str, path: str, range_: str | None, nbytes: int, status: int) -> None:
        with self._lock:
            self.log.append((method, path, range_, nbytes, status))

    def mark(self) -> int:
        with self._lock:
            self.marks.append(len(self.log))
            return len(self.log)

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())


class _Handler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # noqa: A002 - silence per-request logs
        pass

    def _forward(self) -> tuple[int, str, list[tuple[str, str]], bytes]:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        conn = http.client.HTTPConnection(*self.owner.upstream, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.reason, resp.getheaders(), data
        finally:
            conn.close()

    def _send_head(self, status: int, reason: str, headers, length: int) -> None:
        self.send_response(status, reason)
        for key, value in headers:
            if key.lower() not in _HOP and key.lower() not in ("server", "date"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(length))
        self.send_header("Connection", "close")
        self.end_headers()

    def _handle(self) -> None:
        self.close_connection = True
        if self.path == "/__proxy__/mark":
            body = str(self.owner.mark()).encode()
            self._send_head(200, "OK", [("Content-Type", "text/plain")], len(body))
            self.wfile.write(body)
            return
        kind = self.owner.draw(self.command)
        if kind == "slowdown":
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            self.owner.record(self.command, self.path, self.headers.get("Range"), 0, 503)
            self._send_head(503, "Slow Down", [("Content-Type", "application/xml")], len(_SLOWDOWN))
            self.wfile.write(_SLOWDOWN)
            return
        if kind == "stall":
            self.owner._stopping.wait(self.owner.stall_s)
            return
        status, reason, headers, data = self._forward()
        self.owner.record(self.command, self.path, self.headers.get("Range"), len(data) if kind is None else 0, status)
        self._send_head(status, reason, headers, len(data))
        if kind is None or self.command == "HEAD" or not data:
            if self.command != "HEAD":
                if self.command == "GET":  # counted before the client can see it
                    self.owner.served(len(data))
                self.wfile.write(data)
            return
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        if kind == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
