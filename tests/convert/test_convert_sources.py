import gzip
import shutil

import numpy as np
import pytest

from helpers.convert import (
    assert_same_docs,
    random_docs,
    read_stream,
    write_jsonl,
    write_megatron,
)
from streamforge.convert import convert


def test_megatron_multi_sequence_documents(tmp_path, rng):
    seqs = random_docs(rng, 60)
    doc_idx = [0, 1, 4, 4, 10, 30, 31, 60]  # includes a document with no sequences
    prefix = write_megatron(tmp_path / "corpus", seqs, doc_idx)
    m = convert("megatron", f"{prefix}.bin", tmp_path / "out", shard_size="8KiB", frame_size="2KiB")
    docs = [np.concatenate([seqs[s] for s in range(a, b)] or [np.zeros(0)]) for a, b in zip(doc_idx, doc_idx[1:])]
    manifest, records = read_stream(tmp_path / "out")
    assert_same_docs(records, docs)
    assert m.num_records == manifest.num_records == len(docs) == 7
    assert manifest.num_tokens == sum(len(d) for d in docs)
    assert manifest.num_shards > 1 and manifest.token_dtype == "uint16"
    assert manifest.conversion["source_format"] == "megatron"
    assert manifest.source_fingerprint and not manifest.docs_end_with_eos


def test_megatron_int32_large_ids_choose_uint32(tmp_path, rng):
    docs = [rng.integers(0, 100_000, size=n).astype(np.int32) for n in (5, 0, 300, 17)]
    prefix = write_megatron(tmp_path / "big", docs, dtype="int32")
    convert("megatron", str(prefix), tmp_path / "out", shard_size="4KiB", eos_id=7)
    manifest, records = read_stream(tmp_path / "out")
    assert manifest.token_dtype == "uint32" and manifest.eos_id == 7
    assert_same_docs(records, docs)


def test_flat_eos_split_keeps_eos_and_tail(tmp_path, rng):
    eos = 50256
    bodies = random_docs(rng, 40, high=eos)
    docs = [np.append(b, eos).astype(np.uint16) for b in bodies]
    tail = np.array([1, 2, 3], np.uint16)
    np.concatenate(docs + [tail]).tofile(tmp_path / "train.bin")
    convert("flat", tmp_path / "train.bin", tmp_path / "out", eos_id=eos, shard_size="16KiB")
    manifest, records = read_stream(tmp_path / "out")
    assert_same_docs(records, docs + [tail])
    assert manifest.docs_end_with_eos and manifest.eos_id == eos


def test_flat_uint32_source(tmp_path):
    tokens = np.array([70000, 5, 0, 9, 0, 0, 1], np.uint32)
    tokens.tofile(tmp_path / "t.bin")
    convert("flat", tmp_path / "t.bin", tmp_path / "out", eos_id=0, dtype="uint32")
    manifest, records = read_stream(tmp_path / "out")
    assert manifest.token_dtype == "uint32"
    assert_same_docs(records, [[70000, 5, 0], [9, 0], [0], [1]])


def test_npy_eos_and_offsets_split(tmp_path, rng):
    docs = random_docs(rng, 50, high=1000)
    flat = np.concatenate(docs).astype(np.int32)
    np.save(tmp_path / "tokens.npy", flat)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    np.save(tmp_path / "offsets.npy", offsets)
    convert("npy", tmp_path / "tokens.npy", tmp_path / "by_offsets", offsets=tmp_path / "offsets.npy",
            shard_size="8KiB")
    manifest, records = read_stream(tmp_path / "by_offsets")
    assert_same_docs(records, docs)  # zero-length documents stay as zero-token records
    assert manifest.token_dtype == "uint16"

    eos_docs = [np.append(d, 1000) for d in docs]
    np.save(tmp_path / "eos.npy", np.concatenate(eos_docs).astype(np.uint16))
    convert("npy", tmp_path / "eos.npy", tmp_path / "by_eos", eos_id=1000, vocab_size=1001)
    manifest, records = read_stream(tmp_path / "by_eos")
    assert_same_docs(records, eos_docs)
    assert manifest.vocab_size == 1001 and manifest.docs_end_with_eos


def test_npy_raw_memmap_needs_dtype(tmp_path):
    np.array([3, 4, 0, 5, 0], np.uint16).tofile(tmp_path / "raw.dat")
    convert("npy", tmp_path / "raw.dat", tmp_path / "out", eos_id=0, dtype="uint16")
    _, records = read_stream(tmp_path / "out")
    assert_same_docs(records, [[3, 4, 0], [5, 0]])


def test_jsonl_rows_in_order_across_files(tmp_path, rng):
    docs = random_docs(rng, 30, high=60000)
    (tmp_path / "src").mkdir()
    write_jsonl(tmp_path / "src" / "a.jsonl", docs[:20], field="ids")
    write_jsonl(tmp_path / "b.jsonl", docs[20:], field="ids")
    with open(tmp_path / "b.jsonl", "rb") as f, gzip.open(tmp_path / "src" / "b.jsonl.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    m = convert("jsonl", tmp_path / "src", tmp_path / "out", field="ids", shard_size="4KiB")
    _, records = read_stream(tmp_path / "out")
    assert_same_docs(records, docs)
    assert m.conversion["field"] == "ids"


def test_parquet_rows(tmp_path, rng):
    pa = pytest.importorskip("pyarrow", reason="the parquet converter needs pyarrow")
    import pyarrow.parquet as pq

    docs = random_docs(rng, 40, high=60000)
    table = pa.table({"input_ids": pa.array([d.tolist() for d in docs], pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=7)
    convert("parquet", tmp_path / "part-0.parquet", tmp_path / "out", shard_size="4KiB")
    manifest, records = read_stream(tmp_path / "out")
    assert_same_docs(records, docs)
    assert manifest.num_records == 40


def test_limit_converts_a_prefix(tmp_path, rng):
    docs = random_docs(rng, 20, zero_frac=0)
    prefix = write_megatron(tmp_path / "c", docs)
    m = convert("megatron", prefix, tmp_path / "out", limit=7)
    _, records = read_stream(tmp_path / "out")
    assert_same_docs(records, docs[:7])
    assert m.conversion["limit"] == 7
