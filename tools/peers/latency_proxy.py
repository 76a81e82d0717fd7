"""An HTTP proxy on 127.0.0.1 that makes a loopback S3 server answer like object storage in a
region: a fixed delay before each response (time to first byte, default 25 ms) and a cap on
each connection's bandwidth (default 100 MB/s), counting requests and body bytes as it goes.

    proxy = LatencyProxy("http://127.0.0.1:PORT", delay_ms=25, bandwidth_mbps=100).start()
    proxy.endpoint_url    # what the clients are pointed at
    proxy.counts()        # {"requests": ..., "gets": ..., "bytes": ...}; reset() zeroes them
    proxy.stop()

``delay_ms=0, bandwidth_mbps=0`` is a plain counting pass-through (no delay, no cap).

Each client connection is kept alive (HTTP/1.1) and has an upstream connection of its own, as a
client's pooled connection to S3 would; a response body is streamed from upstream in 256 KiB
pieces, each sent no earlier than the cap allows since the body began. The delay is added
before the status line of every response, on top of the upstream server's own time.

Run as a script it serves in a process of its own, so that neither the reader's process nor the
benchmark's parent pays for it (``ProxyProcess``, started and stopped by its pid):

    python tools/peers/latency_proxy.py UPSTREAM DELAY_MS:BANDWIDTH_MBPS [...]

prints one endpoint a line, then serves until its stdin closes. Any of its proxies answers
``GET /__proxy__/counts`` (JSON) and ``POST /__proxy__/reset``; neither is counted.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te", "trailer",
        "upgrade"}
CHUNK = 256 << 10
CONTROL = "/__proxy__/"


class LatencyProxy:
    """A delaying, bandwidth-capping, counting proxy in front of ``upstream``, on a thread."""

    def __init__(self, upstream: str, *, delay_ms: float = 25.0, bandwidth_mbps: float = 100.0) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.delay = delay_ms / 1000.0
        self.rate = bandwidth_mbps * 1e6  # bytes per second per connection; 0: no cap
        self._lock = threading.Lock()
        self._zero()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _zero(self) -> None:
        self.requests = self.gets = self.bytes = self.connections = 0

    def start(self) -> LatencyProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"requests": self.requests, "gets": self.gets, "bytes": self.bytes,
                    "connections": self.connections}

    def reset(self) -> None:
        with self._lock:
            self._zero()

    def _count(self, method: str) -> None:
        with self._lock:
            self.requests += 1
            self.gets += method == "GET"

    def _sent(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes


class _Handler(BaseHTTPRequestHandler):
    owner: LatencyProxy
    protocol_version = "HTTP/1.1"
    upstream_conn: http.client.HTTPConnection | None = None

    def log_message(self, format, *args) -> None:  # noqa: A002 - no per-request log lines
        pass

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner.connections += 1

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self.upstream_conn is not None:
                self.upstream_conn.close()

    def _control(self) -> None:
        if self.path.startswith(CONTROL + "reset"):
            self.owner.reset()
        body = json.dumps(self.owner.counts()).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _upstream(self, method: str, body: bytes | None, headers: dict) -> http.client.HTTPResponse:
        """The response of the upstream server, on this connection's own upstream connection
        (made again once if the server closed it)."""
        for attempt in (0, 1):
            if self.upstream_conn is None:
                self.upstream_conn = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
            try:
                self.upstream_conn.request(method, self.path, body=body, headers=headers)
                return self.upstream_conn.getresponse()
            except (http.client.HTTPException, ConnectionError):
                self.upstream_conn.close()
                self.upstream_conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _handle(self) -> None:
        if self.path.startswith(CONTROL):
            return self._control()
        owner = self.owner
        owner._count(self.command)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        resp = self._upstream(self.command, body, headers)
        size = resp.getheader("Content-Length")
        data = None
        if size is None and self.command != "HEAD":  # chunked upstream: whole, then sent with a length
            data = resp.read()
            size = str(len(data))
        if owner.delay:
            time.sleep(owner.delay)  # the time to first byte a region adds
        self.send_response(resp.status, resp.reason)
        for key, value in resp.getheaders():
            if key.lower() not in _HOP and key.lower() not in ("server", "date"):
                self.send_header(key, value)
        self.send_header("Content-Length", size or "0")
        self.end_headers()
        if self.command == "HEAD":
            resp.read()
            return
        sent, start = 0, time.perf_counter()
        pieces = iter((data,)) if data is not None else iter(lambda: resp.read(CHUNK), b"")
        for piece in pieces:
            if not piece:
                continue
            for lo in range(0, len(piece), CHUNK):
                part = piece[lo : lo + CHUNK]
                if owner.rate:
                    due = start + (sent + len(part)) / owner.rate  # this part may end no earlier
                    wait = due - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                owner._sent(len(part))  # counted before the client can have it: counts read after a
                self.wfile.write(part)  # client's read include it
                sent += len(part)
        self.wfile.flush()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


# -- in a process of its own ---------------------------------------------------------------------
def control(endpoint: str, what: str = "counts") -> dict[str, int]:
    """A proxy's counts over HTTP (``what="reset"`` zeroes them first)."""
    method = "POST" if what == "reset" else "GET"
    req = urllib.request.Request(f"{endpoint}{CONTROL}{what}", method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


class ProxyProcess:
    """Proxies in front of ``upstream`` in a child process: one per ``(delay_ms, bandwidth_mbps)``
    in ``settings``; ``endpoints[i]`` is the i-th one's URL. ``stop()`` closes the child's stdin
    and kills it by its pid if it has not gone in 10 s."""

    def __init__(self, upstream: str, settings: list[tuple[float, float]]) -> None:
        spec = [f"{d:g}:{b:g}" for d, b in settings]
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), upstream, *spec],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self.endpoints = [self.proc.stdout.readline().strip() for _ in settings]
        if not all(e.startswith("http://") for e in self.endpoints):
            self.stop()
            raise RuntimeError(f"the latency proxy did not start (got {self.endpoints!r})")

    def reset(self, endpoint: str) -> None:
        control(endpoint, "reset")

    def counts(self, endpoint: str) -> dict[str, int]:
        return control(endpoint)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.communicate("", timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def serve(argv: list[str]) -> None:
    upstream, specs = argv[0], argv[1:]
    proxies = []
    for spec in specs:
        delay, bandwidth = (float(x) for x in spec.split(":"))
        proxies.append(LatencyProxy(upstream, delay_ms=delay, bandwidth_mbps=bandwidth).start())
        print(proxies[-1].endpoint_url, flush=True)
    sys.stdin.read()
    for proxy in proxies:
        proxy.stop()


if __name__ == "__main__":
    serve(sys.argv[1:])
