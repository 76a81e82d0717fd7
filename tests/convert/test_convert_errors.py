"""Every bad input is refused with a message naming the file, before anything is written."""

import struct

import numpy as np
import pytest

from helpers.convert import write_jsonl, write_megatron
from streamforge.convert import convert
from streamforge.errors import ConfigError, SourceError


def patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def megatron(tmp_path, docs=None, dtype="uint16", doc_idx=None):
    docs = docs if docs is not None else [[1, 2, 3], [4, 5], [6]]
    return write_megatron(tmp_path / "m", docs, doc_idx, dtype=dtype)


def mg_bad_magic(t):
    p = megatron(t); patch(f"{p}.idx", 0, b"XXIDIDX"); return "megatron", p, {}, "m.idx", "magic"
def mg_bad_version(t):
    p = megatron(t); patch(f"{p}.idx", 9, struct.pack("<Q", 2)); return "megatron", p, {}, "m.idx", "version 2"
def mg_bad_code(t):
    p = megatron(t); patch(f"{p}.idx", 17, b"\x09"); return "megatron", p, {}, "m.idx", "dtype code 9"
def mg_float_code(t):
    p = megatron(t); patch(f"{p}.idx", 17, b"\x07"); return "megatron", p, {}, "m.idx", "float32"
def mg_missing_idx(t):
    p = megatron(t); (t / "m.idx").unlink(); return "megatron", p, {}, "m.idx", "not found"
def mg_missing_bin(t):
    p = megatron(t); (t / "m.bin").unlink(); return "megatron", p, {}, "m.bin", "not found"
def mg_truncated_idx(t):
    p = megatron(t)
    data = (t / "m.idx").read_bytes(); (t / "m.idx").write_bytes(data[:-5])
    return "megatron", p, {}, "m.idx", "truncated"
def mg_truncated_bin(t):
    p = megatron(t)
    data = (t / "m.bin").read_bytes(); (t / "m.bin").write_bytes(data[:-4])
    return "megatron", p, {}, "m.bin", "truncated"
def mg_odd_bin(t):
    p = megatron(t)
    with open(t / "m.bin", "ab") as f: f.write(b"\x00")
    return "megatron", p, {}, "m.bin", "not a multiple"
def mg_pointers(t):
    p = megatron(t); patch(f"{p}.idx", 34 + 12 + 8, struct.pack("<q", 0))  # pointer of sequence 1 -> 0
    return "megatron", p, {}, "m.idx", "not increasing"
def mg_doc_idx(t):
    p = megatron(t, doc_idx=[0, 1, 7]); return "megatron", p, {}, "m.idx", "doc_idx"
def mg_dtype_mismatch(t):
    p = megatron(t); return "megatron", p, {"dtype": "int32"}, "m.idx", "--dtype int32"
def mg_negative(t):
    p = megatron(t, docs=[[1, -5]], dtype="int32"); return "megatron", p, {}, "m", "negative token id -5"
def mg_over_vocab(t):
    p = megatron(t); return "megatron", p, {"vocab_size": 5}, "m", "token id 6"
def mg_empty(t):
    p = megatron(t, docs=[], doc_idx=[0]); return "megatron", p, {}, "m", "no documents"
def mg_no_tokens(t):
    p = megatron(t, docs=[[], []]); return "megatron", p, {}, "m", "no tokens"
def flat_no_eos(t):
    np.zeros(4, np.uint16).tofile(t / "f.bin"); return "flat", t / "f.bin", {}, "f.bin", "--eos-id"
def flat_odd(t):
    (t / "f.bin").write_bytes(b"\x01\x00\x02"); return "flat", t / "f.bin", {"eos_id": 0}, "f.bin", "not a multiple"
def flat_empty(t):
    (t / "f.bin").write_bytes(b""); return "flat", t / "f.bin", {"eos_id": 0}, "f.bin", "no tokens"
def flat_missing(t):
    return "flat", t / "nope.bin", {"eos_id": 0}, "nope.bin", "not found"
def flat_forced_dtype(t):
    np.array([70000, 0], np.uint32).tofile(t / "f.bin")
    return "flat", t / "f.bin", {"eos_id": 0, "dtype": "uint32", "token_dtype": "uint16"}, "f.bin", "uint16"
def npy_2d(t):
    np.save(t / "a.npy", np.zeros((2, 2), np.uint16)); return "npy", t / "a.npy", {"eos_id": 0}, "a.npy", "1-D"
def npy_float(t):
    np.save(t / "a.npy", np.zeros(4, np.float32)); return "npy", t / "a.npy", {"eos_id": 0}, "a.npy", "integer"
def npy_raw_no_dtype(t):
    np.zeros(4, np.uint16).tofile(t / "a.dat"); return "npy", t / "a.dat", {"eos_id": 0}, "a.dat", "--dtype"
def npy_truncated(t):
    np.save(t / "a.npy", np.arange(100, dtype=np.uint16))
    data = (t / "a.npy").read_bytes(); (t / "a.npy").write_bytes(data[:-10])
    return "npy", t / "a.npy", {"eos_id": 0}, "a.npy", "truncated"
def npy_offsets_short(t):
    np.save(t / "a.npy", np.arange(10, dtype=np.uint16)); np.save(t / "o.npy", np.array([0, 4, 8]))
    return "npy", t / "a.npy", {"offsets": str(t / "o.npy")}, "o.npy", "10 tokens"
def npy_offsets_decrease(t):
    np.save(t / "a.npy", np.arange(10, dtype=np.uint16)); np.save(t / "o.npy", np.array([0, 6, 4, 10]))
    return "npy", t / "a.npy", {"offsets": str(t / "o.npy")}, "o.npy", "decrease"
def npy_no_split(t):
    np.save(t / "a.npy", np.arange(10, dtype=np.uint16)); return "npy", t / "a.npy", {}, "a.npy", "--offsets"
def jsonl_bad_json(t):
    (t / "d.jsonl").write_text('{"input_ids": [1]}\n{oops\n'); return "jsonl", t / "d.jsonl", {}, "d.jsonl:2", "JSON"
def jsonl_missing_field(t):
    (t / "d.jsonl").write_text('{"text": "hi"}\n'); return "jsonl", t / "d.jsonl", {}, "d.jsonl:1", "'input_ids'"
def jsonl_not_ints(t):
    (t / "d.jsonl").write_text('{"input_ids": [1, 2.5]}\n'); return "jsonl", t / "d.jsonl", {}, "d.jsonl:1", "2.5"
def jsonl_negative(t):
    write_jsonl(t / "d.jsonl", [[1, 2], [-3]]); return "jsonl", t / "d.jsonl", {}, "d.jsonl", "negative"
def jsonl_empty(t):
    (t / "d.jsonl").write_text(""); return "jsonl", t / "d.jsonl", {}, "d.jsonl", "no documents"
def parquet_wrong_type(t):
    pa = pytest.importorskip("pyarrow"); import pyarrow.parquet as pq
    pq.write_table(pa.table({"input_ids": ["a", "b"]}), t / "p.parquet")
    return "parquet", t / "p.parquet", {}, "p.parquet", "list of integers"


CASES = [v for k, v in sorted(globals().items()) if k.startswith(("mg_", "flat_", "npy_", "jsonl_", "parquet_"))]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_is_named_and_nothing_is_written(tmp_path, case):
    fmt, src, kwargs, names, says = case(tmp_path)
    out = tmp_path / "out"
    with pytest.raises((SourceError, ConfigError)) as info:
        convert(fmt, str(src), str(out), **kwargs)
    message = str(info.value)
    assert names in message and says in message, message
    assert not out.exists() or not any(out.iterdir())
