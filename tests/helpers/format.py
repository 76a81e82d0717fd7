"""Shared helpers of the format tests (``from helpers.format import ...``)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from streamforge.format.writer import ShardWriter
from streamforge.source import read_records

ZSTD_CLI = shutil.which("zstd")
needs_zstd_cli = pytest.mark.skipif(
    ZSTD_CLI is None,
    reason="no zstd CLI on PATH (`make test` installs it as root via apt-get install zstd)",
)


def write_stream(url, docs, metas=None, **writer_kwargs):
    """Write ``docs`` (and per-document ``metas``, None entries allowed) as one stream."""
    metas = metas if metas is not None else [None] * len(docs)
    with ShardWriter(str(url), **writer_kwargs) as writer:
        for doc, meta in zip(docs, metas):
            writer.write(doc, meta=meta)
    return writer.close()


def random_docs(rng, count, max_len=300, high=1000, zero_every=7):
    """``count`` documents of random length, every ``zero_every``-th one empty."""
    docs = []
    for i in range(count):
        n = 0 if zero_every and i % zero_every == 3 else int(rng.integers(1, max_len))
        docs.append(rng.integers(0, high, size=n))
    return docs


def shard_path(url, manifest, shard=0):
    return f"{url}/{manifest.shard_names[shard]}"


def flatten_shards(url, manifest):
    """Every record of the stream, in order, via ``read_records``."""
    return [doc for s in range(manifest.num_shards) for doc in read_records(url, s)]


def same_docs(got, expected):
    return len(got) == len(expected) and all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, expected)
    )
