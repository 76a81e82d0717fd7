"""Helpers of the storage tests (``from helpers.storage import ...``)."""

from __future__ import annotations

import numpy as np

from streamforge.format.writer import ShardWriter
from streamforge.source import ShardSource
from streamforge.storage.config import HedgePolicy, RetryPolicy, StorageConfig

FAST_RETRY = RetryPolicy(attempts=8, backoff_base=0.01, backoff_max=0.05, timeout=1.0, jitter=0.5)


def make_docs(seed: int = 7, count: int = 300, max_len: int = 400) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 60000, size=int(n)) for n in rng.integers(0, max_len, size=count)]


def write_corpus(url: str, docs, storage_options=None, shard_size="48KiB", frame_size="4KiB"):
    with ShardWriter(
        url, shard_size=shard_size, frame_size=frame_size, storage_options=storage_options
    ) as writer:
        for doc in docs:
            writer.write(doc)
    return writer.close()


def full_ranges(source: ShardSource) -> list[tuple[int, int, int]]:
    counts = source.manifest.columns["num_records"].tolist()
    return [(s, 0, n) for s, n in enumerate(counts)]


def read_all(source: ShardSource, window: int = 37, plan: bool = True):
    """Every record of the stream as ``(shard, record, tokens)``, read ``window`` at a time."""
    ranges = full_ranges(source)
    if plan:
        source.plan_reads(ranges)
    out = []
    for shard, start, stop in ranges:
        for a in range(start, stop, window):
            batch = source.read(shard, a, min(stop, a + window))
            out.extend(
                (int(batch.shard[i]), int(batch.record[i]), batch.doc(i).copy())
                for i in range(len(batch))
            )
    return out


def tokens_of(records) -> list[np.ndarray]:
    return [t for _, _, t in records]


def same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def config(**kwargs) -> StorageConfig:
    """Test storage settings. No hedging unless asked for (test_hedge.py): a read slowed by a
    loaded machine would get a twin and fetch its bytes twice, and these tests count bytes."""
    kwargs.setdefault("retry", FAST_RETRY)
    kwargs.setdefault("hedge", HedgePolicy(enabled=False))
    kwargs.setdefault("request_bytes", 16 << 10)
    kwargs.setdefault("prefetch_bytes", 64 << 10)
    return StorageConfig(**kwargs)


def batches(loader, limit=None) -> list[dict[str, np.ndarray]]:
    """The loader's batches as numpy copies (at most ``limit``)."""
    out = []
    for batch in loader:
        out.append({k: np.asarray(v).copy() for k, v in batch.items()})
        if limit is not None and len(out) == limit:
            break
    return out


def equal(a, b) -> bool:
    """Two lists of batches are the same, key by key, bit for bit."""
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )
