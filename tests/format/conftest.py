"""Fixtures of the format tests: tiny real streams written into a temporary directory."""

from __future__ import annotations

import pytest

from helpers.format import random_docs, write_stream


@pytest.fixture
def small_stream(tmp_path, rng):
    """60 documents (some empty, half with metadata) in several shards and frames.

    Returns ``(url, docs, metas, manifest)``.
    """
    docs = random_docs(rng, 60)
    metas = [{"doc": i} if i % 2 else None for i in range(len(docs))]
    url = str(tmp_path / "stream")
    manifest = write_stream(url, docs, metas, shard_size="8KiB", frame_size="2KiB", eos_id=999)
    assert manifest.num_shards > 2
    return url, docs, metas, manifest
