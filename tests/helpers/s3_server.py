"""A real S3 server for tests: ``streamforge.demo.s3.LoopbackS3`` (moto's ThreadedMotoServer on
127.0.0.1, on a thread of the test process), reached over HTTP.

One server per test session (starting one takes ~1 s); ``s3_bucket`` and ``new_bucket`` give
each test a bucket of its own, so tests never see each other's objects.
"""

from __future__ import annotations

import itertools
import os

import pytest

from streamforge.demo.s3 import LoopbackS3, free_port

__all__ = ["S3Server", "free_port", "s3_bucket", "s3_server"]

_counter = itertools.count()


class S3Server(LoopbackS3):
    """The session's server, with uniquely named buckets for the tests."""

    def new_bucket(self, prefix: str = "bucket") -> str:
        name = f"{prefix}-{os.getpid()}-{next(_counter)}"
        self.filesystem().mkdir(name)
        return name


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server(key="testing", secret="testing").start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """``(bucket_name, storage_options)`` of an empty bucket of its own."""
    return s3_server.new_bucket(), s3_server.storage_options()
