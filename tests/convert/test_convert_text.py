"""Raw text to streams with real tokenizers trained in the test: every kind, every input
form, bad rows, used prefixes, and the tokenizer check of the dataset."""

from __future__ import annotations

import gzip
import json

import fsspec
import pytest

pytest.importorskip("tokenizers", reason="text conversion tests need the 'text' extra (tokenizers)")

from helpers.convert import read_stream  # noqa: E402
from helpers.text import (  # noqa: E402
    TIKTOKEN_PATTERN,
    make_docs,
    split_files,
    train_hf,
    train_sentencepiece,
    tree_digests,
    write_text_jsonl,
    write_text_parquet,
    write_tiktoken,
)

from streamforge.cli import main  # noqa: E402
from streamforge.convert import convert  # noqa: E402
from streamforge.errors import ConfigError, SourceError  # noqa: E402
from streamforge.format.verify import verify_stream  # noqa: E402


@pytest.fixture
def docs(rng):
    return make_docs(rng, 240)


@pytest.fixture
def hf_tok(tmp_path, docs):
    return train_hf(tmp_path / "tokenizer.json", docs)


def expected_hf(path, docs):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    eos = tok.token_to_id("<|endoftext|>")
    return [tok.encode(d).ids + [eos] if d else [] for d in docs], eos


def assert_records(records, want):
    assert len(records) == len(want)
    for k, (got, ids) in enumerate(zip(records, want)):
        assert got.tolist() == ids, f"record {k} differs"


def text_convert(src, out, tok, **kw):
    kw.setdefault("shard_size", "16KiB")
    return convert("jsonl", src, out, text_field="text", tokenizer=tok, progress=False, **kw)


def test_hf_jsonl_round_trip_and_manifest(tmp_path, docs, hf_tok, capsys):
    src = write_text_jsonl(tmp_path / "docs.jsonl", docs)
    m = text_convert(src, tmp_path / "out", hf_tok)
    want, eos = expected_hf(hf_tok, docs)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(hf_tok).get_vocab_size()
    manifest, records = read_stream(str(tmp_path / "out"))
    assert_records(records, want)
    assert m.num_shards > 3 and m.token_dtype == "uint16"
    assert m.eos_id == eos and m.docs_end_with_eos and m.vocab_size == vocab
    tok = manifest.tokenizer
    assert (tok["kind"], tok["vocab_size"], tok["eos_id"], tok["name"]) == ("hf", vocab, eos, "tokenizer.json")
    import hashlib

    assert tok["sha256"] == hashlib.sha256(open(hf_tok, "rb").read()).hexdigest()
    assert manifest.conversion["skipped_rows"] == {"count": 0, "listed": []}
    assert verify_stream(str(tmp_path / "out")) == []
    assert not (tmp_path / "out" / "_convert-state").exists()
    assert main(["inspect", str(tmp_path / "out")]) == 0
    shown = capsys.readouterr().out
    assert "tokenizer    hf tokenizer.json" in shown and "tokenized from text" in shown
    # converting the same text again into the same prefix keeps every (verified) shard
    before = tree_digests(fsspec.filesystem("file"), str(tmp_path / "out"))
    text_convert(src, tmp_path / "out", hf_tok)
    assert tree_digests(fsspec.filesystem("file"), str(tmp_path / "out")) == before


def test_compressed_jsonl_and_parquet_row_groups(tmp_path, docs, hf_tok):
    split_files(tmp_path / "plain", docs, 3, ".jsonl")
    split_files(tmp_path / "gz", docs, 3, ".jsonl.gz")
    split_files(tmp_path / "zst", docs, 3, ".jsonl.zst")
    outs = {}
    for name in ("plain", "gz", "zst"):
        text_convert(tmp_path / name, tmp_path / f"out-{name}", hf_tok)
        outs[name] = tree_digests(fsspec.filesystem("file"), str(tmp_path / f"out-{name}"))
    assert outs["plain"] == outs["gz"] == outs["zst"]  # same text, same bytes
    write_text_parquet(tmp_path / "docs.parquet", docs, row_group_size=50)
    m = convert("parquet", tmp_path / "docs.parquet", tmp_path / "pq", text_field="text",
                tokenizer=hf_tok, shard_size="16KiB", progress=False)
    assert m.conversion["num_slices"] == 5  # 240 rows in row groups of 50
    assert_records(read_stream(str(tmp_path / "pq"))[1], expected_hf(hf_tok, docs)[0])


def test_sentencepiece_and_tiktoken(tmp_path, docs):
    import sentencepiece
    import tiktoken
    import tiktoken.load

    src = write_text_jsonl(tmp_path / "docs.jsonl", docs)
    sp_path = train_sentencepiece(tmp_path / "sp.model", docs)
    m = text_convert(src, tmp_path / "sp", sp_path)
    sp = sentencepiece.SentencePieceProcessor(model_file=sp_path)
    want = [sp.encode(d) + [sp.eos_id()] if d else [] for d in docs]
    assert_records(read_stream(str(tmp_path / "sp"))[1], want)
    assert (m.tokenizer["kind"], m.vocab_size, m.eos_id) == ("sentencepiece", sp.get_piece_size(), sp.eos_id())

    bpe = write_tiktoken(tmp_path / "tok.tiktoken", docs)
    m = text_convert(src, tmp_path / "tt", bpe, tiktoken_pattern=TIKTOKEN_PATTERN)
    ranks = tiktoken.load.load_tiktoken_bpe(bpe)
    eos = len(ranks)
    enc = tiktoken.Encoding("t", pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": eos})
    want = [enc.encode_ordinary(d) + [eos] if d else [] for d in docs]
    records = read_stream(str(tmp_path / "tt"))[1]
    assert_records(records, want)
    assert enc.decode(records[1][:-1].tolist()) == docs[1]
    assert (m.tokenizer["kind"], m.tokenizer["pattern"], m.eos_id) == ("tiktoken", TIKTOKEN_PATTERN, eos)
    with pytest.raises(ConfigError, match="split pattern"):
        text_convert(src, tmp_path / "tt2", bpe)


def test_token_dtype_is_the_narrowest_for_the_vocabulary(tmp_path, docs):
    src = write_text_jsonl(tmp_path / "docs.jsonl", docs[:20])
    wide = write_tiktoken(tmp_path / "wide.tiktoken", docs, extra_ranks=70_000)
    m = text_convert(src, tmp_path / "wide", wide, tiktoken_pattern=TIKTOKEN_PATTERN)
    assert m.token_dtype == "uint32" and m.vocab_size > 65536
    narrow = write_tiktoken(tmp_path / "narrow.tiktoken", docs)
    m = text_convert(src, tmp_path / "narrow", narrow, tiktoken_pattern=TIKTOKEN_PATTERN)
    assert m.token_dtype == "uint16"


def bad_jsonl(path):
    lines = [
        json.dumps({"text": "good one"}).encode(),
        json.dumps({"body": "no text field"}).encode(),
        json.dumps({"text": 42}).encode(),
        b'{"text": "bad \xff\xfe bytes"}',
        b'{"text": "lone \\ud800 surrogate"}',
        b"not json at all",
        json.dumps({"text": "good two"}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_bad_rows_raise_before_anything_is_written(tmp_path, hf_tok):
    src = bad_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(SourceError, match=r"bad.jsonl:2: no field 'text'"):
        text_convert(src, tmp_path / "out", hf_tok)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_bad_rows_skipped_are_counted_and_listed(tmp_path, hf_tok, capsys):
    src = bad_jsonl(tmp_path / "bad.jsonl")
    code = main(["convert", "--from", "jsonl", "--input", src, "--output", str(tmp_path / "out"),
                 "--text-field", "text", "--tokenizer", hf_tok, "--on-bad-row", "skip"])
    assert code == 0
    manifest, records = read_stream(str(tmp_path / "out"))
    assert_records(records, expected_hf(hf_tok, ["good one", "good two"])[0])
    skipped = manifest.conversion["skipped_rows"]
    assert skipped["count"] == 5
    reasons = "\n".join(skipped["listed"])
    for line, why in ((2, "no field"), (3, "is int"), (4, "not valid UTF-8"), (5, "lone surrogate"),
                      (6, "not valid JSON")):
        assert f"bad.jsonl:{line}: " in reasons and why in reasons
    out = capsys.readouterr().out
    assert "skipped rows: 5" in out and "bad.jsonl:2" in out


def test_parquet_bad_rows(tmp_path, hf_tok):
    path = write_text_parquet(tmp_path / "b.parquet", [b"fine", None, b"\xff oops", b"also fine"],
                              binary=True, row_group_size=2)
    with pytest.raises(SourceError, match=r"b.parquet: row 1: column 'text' is null"):
        convert("parquet", path, tmp_path / "x", text_field="text", tokenizer=hf_tok, progress=False)
    m = convert("parquet", path, tmp_path / "y", text_field="text", tokenizer=hf_tok,
                on_bad_row="skip", progress=False)
    assert m.num_records == 2 and m.conversion["skipped_rows"]["count"] == 2
    assert "row 2: column 'text' is not valid UTF-8" in m.conversion["skipped_rows"]["listed"][1]
    with pytest.raises(SourceError, match="no column 'body'"):
        convert("parquet", path, tmp_path / "z", text_field="body", tokenizer=hf_tok, progress=False)


def test_used_prefix_refused_and_overwrite_removes_unlisted(tmp_path, docs, hf_tok):
    src = write_text_jsonl(tmp_path / "docs.jsonl", docs)
    small = text_convert(src, tmp_path / "out", hf_tok, shard_size="8KiB")
    with pytest.raises(ConfigError, match="already holds a different dataset"):
        text_convert(src, tmp_path / "out", hf_tok, shard_size="64KiB")
    big = text_convert(src, tmp_path / "out", hf_tok, shard_size="64KiB", overwrite=True)
    assert big.num_shards < small.num_shards
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted(["index.json", *big.shard_names])
    # stray shards without a manifest are someone else's too
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "shard-000000.tar.zst").write_bytes(b"x")
    with pytest.raises(ConfigError, match="1 shards and no manifest"):
        text_convert(src, tmp_path / "stray", hf_tok)


def test_token_converter_overwrite_removes_old_extra_shards(tmp_path, rng):
    from helpers.convert import random_docs, write_megatron

    write_megatron(tmp_path / "c", random_docs(rng, 200, zero_frac=0))
    small = convert("megatron", tmp_path / "c", tmp_path / "out", shard_size="16KiB")
    with pytest.raises(ConfigError, match="already holds a different dataset"):
        convert("megatron", tmp_path / "c", tmp_path / "out", shard_size="64KiB")
    big = convert("megatron", tmp_path / "c", tmp_path / "out", shard_size="64KiB", overwrite=True)
    assert big.num_shards < small.num_shards
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(["index.json", *big.shard_names])


def test_one_and_two_workers_write_the_same_bytes(tmp_path, rng, hf_tok):
    docs = make_docs(rng, 600)
    split_files(tmp_path / "in", docs, 5, ".jsonl.gz")
    for w in (1, 2):
        text_convert(tmp_path / "in", tmp_path / f"w{w}", hf_tok, workers=w)
    fs = fsspec.filesystem("file")
    assert tree_digests(fs, str(tmp_path / "w1")) == tree_digests(fs, str(tmp_path / "w2"))


def test_streams_with_different_tokenizers_do_not_mix(tmp_path, docs, hf_tok):
    from streamforge import PackedTokenDataset, Stream

    src = write_text_jsonl(tmp_path / "docs.jsonl", docs)
    other = train_hf(tmp_path / "other.json", docs, vocab_size=350)
    text_convert(src, tmp_path / "a", hf_tok)
    text_convert(src, tmp_path / "a2", hf_tok)
    text_convert(src, tmp_path / "b", other)
    PackedTokenDataset([Stream(str(tmp_path / "a"), name="a"), Stream(str(tmp_path / "a2"), name="a2")], seq_len=64)
    with pytest.raises(ConfigError, match=r"'a' and 'b' were tokenized with different tokenizers: hf tokenizer.json .* hf other.json"):
        PackedTokenDataset([Stream(str(tmp_path / "a"), name="a"), Stream(str(tmp_path / "b"), name="b")], seq_len=64)


def test_text_options_are_checked(tmp_path, docs, hf_tok):
    src = write_text_jsonl(tmp_path / "docs.jsonl", docs)
    with pytest.raises(ConfigError, match="both text_field"):
        convert("jsonl", src, tmp_path / "o", tokenizer=hf_tok)
    with pytest.raises(ConfigError, match="not found"):
        text_convert(src, tmp_path / "o", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="cannot tell the tokenizer kind"):
        text_convert(src, tmp_path / "o", src)
    with pytest.raises(ConfigError, match="limit apply to token-id sources"):
        text_convert(src, tmp_path / "o", hf_tok, limit=3)
    with pytest.raises(ConfigError, match="engine 'ray' runs text conversions only"):
        convert("jsonl", src, tmp_path / "o", engine="ray")
    with gzip.open(tmp_path / "empty.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": 1}) + "\n")
    with pytest.raises(SourceError, match="no documents"):
        text_convert(tmp_path / "empty.jsonl.gz", tmp_path / "o", hf_tok, on_bad_row="skip")


def test_progress_bar_and_summary(tmp_path, docs, hf_tok, capsys):
    src = write_text_jsonl(tmp_path / "docs.jsonl", docs)
    convert("jsonl", src, tmp_path / "out", text_field="text", tokenizer=hf_tok, progress=True)
    err = capsys.readouterr().err
    assert "scan" in err and "tokenize" in err and "docs/s" in err and "tok/s" in err
    assert "converted 240 documents" in err and "0 rows skipped" in err

