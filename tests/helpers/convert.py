"""Source writers for converter tests, following each format's published layout."""

from __future__ import annotations

import json
import struct

import numpy as np

from streamforge.format.manifest import Manifest
from streamforge.source import read_records

MEGATRON_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}


def write_megatron(prefix, sequences, doc_idx=None, dtype="uint16"):
    """Write ``prefix.bin``/``prefix.idx``; ``doc_idx`` defaults to one sequence per document."""
    dtype = np.dtype(dtype)
    sizes = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.zeros(len(sizes), np.int64)
    if len(sizes) > 1:
        pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize)
    if doc_idx is None:
        doc_idx = list(range(len(sequences) + 1))
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(np.asarray(s, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", MEGATRON_CODES[dtype.name]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_idx.tobytes())
    return prefix


def write_jsonl(path, docs, field="input_ids"):
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: [int(t) for t in d]}) + "\n")
    return path


def random_docs(rng, num_docs, *, high=50000, max_len=400, zero_frac=0.1, dtype=np.uint16):
    lengths = rng.integers(0, max_len, size=num_docs)
    lengths[rng.random(num_docs) < zero_frac] = 0
    return [rng.integers(0, high, size=int(n)).astype(dtype) for n in lengths]


def read_stream(url, storage_options=None):
    """(manifest, every record's tokens in stream order)."""
    manifest = Manifest.load(url, storage_options)
    records = [
        r
        for s in range(manifest.num_shards)
        for r in read_records(url, s, storage_options=storage_options)
    ]
    return manifest, records


def assert_same_docs(records, docs):
    assert len(records) == len(docs), (len(records), len(docs))
    for k, (got, want) in enumerate(zip(records, docs)):
        assert np.array_equal(got, np.asarray(want, dtype=np.int64)), f"record {k} differs"
