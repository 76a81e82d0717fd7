"""A loopback S3 server for the demo, the tests and the benchmarks: moto's ``ThreadedMotoServer``
on 127.0.0.1, on a free port.

    s3 = LoopbackS3().start()                 # a thread of this process
    url = s3.upload("corpus/web", "demo", "web")  # "s3://demo/web", the bucket made if missing
    Stream(url, storage_options=s3.storage_options())
    s3.stop()

``LoopbackS3(in_process=False)`` runs the server in a child process instead, so that a
benchmark does not count the server's CPU and memory as the reader's; ``stop()`` ends that
child through its own handle (stdin closed, then ``SIGKILL`` if it does not exit). ``reset()``
drops every bucket (moto's ``POST /moto-api/reset``).

moto is an optional dependency (``moto[server]``): it is imported when a server starts, and a
missing moto is an ``ImportError`` from ``start()``. Uploads and buckets go through s3fs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request

HOST = "127.0.0.1"
REGION = "us-east-1"

# the child of ``in_process=False``: moto alone (not streamforge, so it starts in about a second)
_CHILD = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address=sys.argv[1], port=int(sys.argv[2]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()
server.stop()
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class LoopbackS3:
    """moto's S3 on 127.0.0.1: start, stop, reset, buckets, uploads and the options to read it.

    Args:
        key: the access key id clients send (moto accepts any).
        secret: the secret access key clients send.
        in_process: run the server on a thread of this process (True) or in a child process
            of its own (False).
    """

    def __init__(self, *, key: str = "testing", secret: str = "testing", in_process: bool = True) -> None:
        self.key, self.secret, self.in_process = key, secret, in_process
        self.port: int | None = None
        self.endpoint_url: str | None = None
        self._server = None  # ThreadedMotoServer, in_process=True
        self._proc: subprocess.Popen | None = None  # the child, in_process=False

    # -- lifetime ---------------------------------------------------------------------------
    def start(self) -> LoopbackS3:
        """Start the server on a free port; returns self. In this process, the AWS credential
        variables get defaults (``env()``) for clients that read them."""
        self.port = free_port()
        self.endpoint_url = f"http://{HOST}:{self.port}"
        if self.in_process:
            from moto.server import ThreadedMotoServer

            for var, value in self.env().items():
                os.environ.setdefault(var, value)
            self._server = ThreadedMotoServer(ip_address=HOST, port=self.port, verbose=False)
            self._server.start()
            return self
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, HOST, str(self.port)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                      env={**os.environ, **self.env()})
        if self._proc.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError(f"the moto S3 server did not start on {self.endpoint_url} (is moto[server] installed?)")
        return self

    def stop(self) -> None:
        """Stop the server this object started (and nothing else)."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._proc is not None:
            if self._proc.poll() is None:
                try:
                    self._proc.communicate("", timeout=30)
                except subprocess.TimeoutExpired:
                    os.kill(self._proc.pid, signal.SIGKILL)
                    self._proc.wait()
            self._proc = None

    def __enter__(self) -> LoopbackS3:
        return self.start() if self._server is None and self._proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def reset(self) -> None:
        """Drop every bucket and object (moto's ``/moto-api/reset``)."""
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    # -- clients ----------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """The AWS variables for clients that read credentials from the environment (boto3)."""
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": REGION}

    def storage_options(self, endpoint_url: str | None = None, *, skip_instance_cache: bool = True) -> dict:
        """``storage_options`` for a ``Stream`` or ``ShardWriter`` (s3fs-style; streamforge's
        obstore and signed-HTTP clients read the same keys). ``endpoint_url`` points the client
        elsewhere (a proxy in front of this server); ``skip_instance_cache`` gives each
        s3fs filesystem a client of its own."""
        options = {"key": self.key, "secret": self.secret,
                   "client_kwargs": {"endpoint_url": endpoint_url or self.endpoint_url}}
        if skip_instance_cache:
            options["skip_instance_cache"] = True
        return options

    def filesystem(self):
        """An s3fs filesystem on this server."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options())

    def create_bucket(self, name: str) -> str:
        """Make bucket ``name`` unless it exists; returns the name."""
        fs = self.filesystem()
        if not fs.exists(name):
            fs.mkdir(name)
        return name

    def upload(self, local: str | os.PathLike, bucket: str, prefix: str) -> str:
        """Copy the directory ``local`` under ``s3://bucket/prefix/`` (the bucket made if
        missing); returns that URL."""
        fs = self.filesystem()
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        fs.put(str(local).rstrip("/") + "/", f"{bucket}/{prefix}/", recursive=True)
        return f"s3://{bucket}/{prefix}"
