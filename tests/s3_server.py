"""A real S3 server for tests: moto's ThreadedMotoServer on 127.0.0.1, reached over HTTP.

One server per test session (starting one takes ~1 s); ``fresh_bucket`` gives each test its
own bucket so tests never see each other's objects.
"""

from __future__ import annotations

import itertools
import os
import socket
from contextlib import closing

import pytest

_counter = itertools.count()


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    def start(self) -> S3Server:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def storage_options(self, endpoint_url: str | None = None) -> dict:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint_url or self.endpoint_url},
            "skip_instance_cache": True,
        }

    def new_bucket(self, prefix: str = "bucket") -> str:
        import s3fs

        name = f"{prefix}-{os.getpid()}-{next(_counter)}"
        s3fs.S3FileSystem(**self.storage_options()).mkdir(name)
        return name


@pytest.fixture(scope="session")
def s3_server():
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(var, value)
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """``(bucket_name, storage_options)`` of an empty bucket of its own."""
    return s3_server.new_bucket(), s3_server.storage_options()
