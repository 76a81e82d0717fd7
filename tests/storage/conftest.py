"""Fixtures of the storage tests: one corpus, written once per backend under test."""

from __future__ import annotations

import pytest

from helpers.storage import make_docs, write_corpus

BACKENDS = ("local", "file", "s3")


@pytest.fixture(scope="module")
def docs():
    return make_docs()


def _location(kind, tmp_path, s3_server):
    if kind == "local":
        return str(tmp_path / "web"), None
    if kind == "file":
        return f"file://{tmp_path / 'web'}", None
    bucket = s3_server.new_bucket()
    return f"s3://{bucket}/web", s3_server.storage_options()


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path_factory, s3_server):
    """``(kind, url, storage_options)`` of an empty location on each backend."""
    kind = request.param
    return (kind, *_location(kind, tmp_path_factory.mktemp(kind), s3_server))


@pytest.fixture(scope="module", params=BACKENDS)
def corpus(request, tmp_path_factory, s3_server, docs):
    """``(kind, url, storage_options, manifest)``: the test corpus on each backend."""
    kind = request.param
    url, opts = _location(kind, tmp_path_factory.mktemp(kind), s3_server)
    manifest = write_corpus(url, docs, opts)
    assert manifest.num_shards >= 4
    return kind, url, opts, manifest


@pytest.fixture(scope="module")
def s3_corpus(s3_server, docs):
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/web"
    opts = s3_server.storage_options()
    return url, opts, write_corpus(url, docs, opts)
