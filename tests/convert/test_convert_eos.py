"""Documents that already end with EOS: detection at conversion, the flag, and the batches.

Megatron's ``preprocess_data.py --append-eod`` (and many npy/jsonl pipelines) end every
document with the EOS id. The converter must record that in the manifest so the pipeline
appends nothing; these tests build such corpora in each source format, convert them with the
real converters and read them back as shards and as packed batches.
"""

import json
import shutil
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.convert import assert_same_docs, read_stream, write_jsonl, write_megatron
from helpers.pipeline import take
from streamforge import PackedTokenDataset, StreamingLoader
from streamforge.cli import main
from streamforge.convert import convert, open_source
from streamforge.convert.eos import decide, describe
from streamforge.errors import ConfigError, SourceError
from streamforge.format.manifest import MANIFEST_NAME, Manifest

EOS = 50256
SEQ_LEN = 64


def eod_corpus(rng, num_docs, *, max_sentences=3, max_len=20):
    """Megatron ``--append-eod`` documents: sentences (sequences) of ids below EOS, the last
    sentence of each document ending with EOS; some sentences are empty.

    Returns (sequences, doc_idx, documents). Every document is at most ``max_sentences *
    max_len + 1`` tokens, below ``SEQ_LEN``, so no packing mode drops a token.
    """
    sequences, doc_idx, docs = [], [0], []
    for _ in range(num_docs):
        sentences = [
            rng.integers(1, EOS, size=int(rng.integers(0, max_len))).astype(np.uint16)
            for _ in range(int(rng.integers(1, max_sentences + 1)))
        ]
        if not len(sentences[-1]):  # a document is never just an EOS
            sentences[-1] = rng.integers(1, EOS, size=1).astype(np.uint16)
        sentences[-1] = np.append(sentences[-1], EOS).astype(np.uint16)
        sequences += sentences
        doc_idx.append(len(sequences))
        docs.append(np.concatenate(sentences))
    return sequences, doc_idx, docs


def one_pass(url, packing, boundary, **kwargs):
    dataset = PackedTokenDataset(
        url, seq_len=SEQ_LEN, packing=packing, boundary=boundary, shuffle_buffer=16, seed=3,
        provenance=True, **kwargs
    )
    return take(StreamingLoader(dataset, batch_size=4))


def assert_pieces_are_documents(batches, url, docs, eos=None):
    """Every document piece in the batches is a slice of its source document, with ``eos``
    appended when given (what the pipeline adds): nothing else, so no extra EOS anywhere.
    Returns the number of pieces checked."""
    first = Manifest.load(url).first_records
    checked = 0
    for b in batches:
        ids, segs = b["input_ids"], b["segments"]
        for row in range(ids.shape[0]):
            t = 0
            for stream, shard, record, start, length in segs[row].tolist():
                if stream < 0:
                    break
                doc = np.asarray(docs[int(first[shard]) + record], np.int64)
                full = doc if eos is None else np.append(doc, eos)
                assert start + length <= len(full), f"piece runs past document {first[shard] + record}"
                assert ids[row, t : t + length].tolist() == full[start : start + length].tolist()
                t += length
                checked += 1
    assert checked
    return checked


def doubled_eos(batches, eos):
    """Places where EOS follows EOS inside the real (non-padding) tokens, counting the
    label of the last position of a row (the next row's first token)."""
    count = 0
    for b in batches:
        ids, labels, real = b["input_ids"], b["labels"], b["doc_ids"] >= 0
        is_eos = (ids == eos) & real
        count += int((is_eos[:, 1:] & is_eos[:, :-1]).sum())
        count += int((is_eos[:, -1] & (labels[:, -1] == eos)).sum())
    return count


def real_tokens(batches, eos):
    total = sum(int((b["doc_ids"] >= 0).sum()) for b in batches)
    eos_count = sum(int(((b["input_ids"] == eos) & (b["doc_ids"] >= 0)).sum()) for b in batches)
    return total, eos_count


@pytest.fixture(scope="module")
def eod_stream(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eod")
    sequences, doc_idx, docs = eod_corpus(np.random.default_rng(9), 150)
    prefix = write_megatron(tmp / "web_text_document", sequences, doc_idx)
    url = str(tmp / "stream")
    convert("megatron", prefix, url, eos_id=EOS, shard_size="4KiB", frame_size="1KiB")
    return prefix, url, docs


def test_megatron_append_eod_is_detected(eod_stream):
    _, url, docs = eod_stream
    manifest, records = read_stream(url)
    assert_same_docs(records, docs)  # nothing added, nothing removed
    assert manifest.docs_end_with_eos and manifest.eos_id == EOS
    check = manifest.conversion["eos_check"]
    assert check == {
        "requested": "auto", "eos_id": EOS, "decided_by": "detected", "docs_with_eos": len(docs),
        "docs_without_eos": 0, "empty_docs": 0, "eos_appended": 0,
    }
    assert describe(manifest).startswith(f"yes (detected: all {len(docs)} non-empty documents")


@pytest.mark.parametrize("packing", ["concat", "bestfit", "pad"])
@pytest.mark.parametrize("boundary", ["document", "stream"])
def test_append_eod_stream_never_gets_a_second_eos(eod_stream, packing, boundary):
    _, url, docs = eod_stream
    batches = one_pass(url, packing, boundary)
    assert doubled_eos(batches, EOS) == 0
    assert_pieces_are_documents(batches, url, docs)  # one EOS per document, none added
    total, eos_count = real_tokens(batches, EOS)
    assert total <= sum(len(d) for d in docs) and eos_count <= len(docs)
    for b in batches:  # an EOS is never the target of an EOS
        assert not ((b["input_ids"] == EOS) & (b["labels"] == EOS)).any()
    # Passing eos_id to the dataset does not make the pipeline append one either.
    assert doubled_eos(one_pass(url, packing, boundary, eos_id=EOS), EOS) == 0


def test_forcing_no_on_an_append_eod_corpus_doubles_eos(eod_stream, tmp_path):
    """What the issue reported, now only on request: the check above would catch it."""
    prefix, _, docs = eod_stream
    url = str(tmp_path / "forced_no")
    m = convert("megatron", prefix, url, eos_id=EOS, docs_end_with_eos="no", shard_size="4KiB")
    assert not m.docs_end_with_eos
    assert m.conversion["eos_check"]["decided_by"] == "requested"
    assert "get a second one" in describe(m)
    batches = one_pass(url, "concat", "document")
    assert doubled_eos(batches, EOS) > len(docs) // 2
    assert_pieces_are_documents(batches, url, docs, eos=EOS)


def test_documents_without_eos_get_one_from_the_pipeline(tmp_path, rng):
    docs = [rng.integers(1, EOS, size=n).astype(np.uint16) for n in rng.integers(1, 40, 60)]
    prefix = write_megatron(tmp_path / "plain", docs)
    url = str(tmp_path / "out")
    m = convert("megatron", prefix, url, eos_id=EOS, shard_size="4KiB")
    assert not m.docs_end_with_eos and m.conversion["eos_check"]["decided_by"] == "detected"
    assert describe(m).startswith("no (detected: none of the 60 non-empty documents")
    for packing in ("concat", "bestfit", "pad"):
        batches = one_pass(url, packing, "document")
        assert doubled_eos(batches, EOS) == 0
        assert_pieces_are_documents(batches, url, docs, eos=EOS)


def test_megatron_without_eos_id_is_not_checked(tmp_path):
    prefix = write_megatron(tmp_path / "c", [np.array([1, 2, EOS], np.uint16)])
    m = convert("megatron", prefix, tmp_path / "out")
    assert not m.docs_end_with_eos and m.eos_id is None
    assert m.conversion["eos_check"] == {"requested": "auto", "eos_id": None, "decided_by": "eos_unknown"}
    assert "no EOS id was given" in describe(m)
    with pytest.raises(ConfigError, match="--docs-end-with-eos yes needs --eos-id"):
        convert("megatron", prefix, tmp_path / "out2", docs_end_with_eos="yes")
    assert not (tmp_path / "out2").exists()


def mixed_megatron(tmp_path):
    docs = [np.array(d, np.uint16) for d in ([5, 6, 9], [7, 9], [], [8], [1, 2, 9], [3])]
    return write_megatron(tmp_path / "mixed", docs), docs


def test_mixed_corpus_needs_an_explicit_answer(tmp_path):
    prefix, _ = mixed_megatron(tmp_path)
    with pytest.raises(SourceError) as info:
        convert("megatron", prefix, tmp_path / "out", eos_id=9)
    text = str(info.value)
    assert str(prefix) in text
    assert "3 of 5 non-empty documents end with EOS id 9" in text and "2 do not" in text
    assert "the first is document 0" in text and "the first is document 3" in text
    assert "--docs-end-with-eos yes" in text and "--docs-end-with-eos no" in text
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_yes_appends_eos_where_missing(tmp_path):
    prefix, docs = mixed_megatron(tmp_path)
    m = convert("megatron", prefix, tmp_path / "out", eos_id=9, docs_end_with_eos="yes")
    manifest, records = read_stream(tmp_path / "out")
    want = [d if (len(d) == 0 or d[-1] == 9) else np.append(d, 9) for d in docs]
    assert_same_docs(records, want)  # the empty document stays empty
    assert manifest.docs_end_with_eos and manifest.num_tokens == sum(len(d) for d in want)
    assert m.conversion["eos_check"] == {
        "requested": "yes", "eos_id": 9, "decided_by": "requested", "docs_with_eos": 3,
        "docs_without_eos": 2, "empty_docs": 1, "eos_appended": 2,
    }
    assert "EOS appended at conversion to 2 documents" in describe(manifest)
    assert manifest.source_fingerprint.endswith(":eos+2")
    # Other records than a plain conversion of the same source: not silently rewritten.
    with pytest.raises(ConfigError, match="different dataset"):
        convert("megatron", prefix, tmp_path / "out", eos_id=9, docs_end_with_eos="no")
    assert Manifest.load(str(tmp_path / "out")).dumps() == manifest.dumps()


def test_no_keeps_documents_and_records_the_count(tmp_path):
    prefix, docs = mixed_megatron(tmp_path)
    m = convert("megatron", prefix, tmp_path / "out", eos_id=9, docs_end_with_eos=False)
    _, records = read_stream(tmp_path / "out")
    assert_same_docs(records, docs)
    assert not m.docs_end_with_eos and m.conversion["eos_check"]["docs_with_eos"] == 3
    assert "3 documents already end with EOS id 9 and get a second one" in describe(m)


def test_yes_is_deterministic_across_workers_and_widens_the_dtype(tmp_path, rng):
    docs = [rng.integers(1, 1000, size=n).astype(np.uint16) for n in rng.integers(0, 300, 200)]
    prefix = write_megatron(tmp_path / "c", docs)
    big_eos = 70_000  # does not fit the uint16 source: the shards become uint32
    outs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        convert("megatron", prefix, out, eos_id=big_eos, docs_end_with_eos="yes",
                shard_size="4KiB", workers=workers)
        outs.append(out)
    assert (outs[0] / MANIFEST_NAME).read_bytes() == (outs[1] / MANIFEST_NAME).read_bytes()
    manifest, records = read_stream(outs[1])
    assert manifest.token_dtype == "uint32" and manifest.num_shards > 1
    assert_same_docs(records, [np.append(d, big_eos) if len(d) else d for d in docs])
    with pytest.raises(ConfigError, match="uint16"):
        convert("megatron", prefix, tmp_path / "narrow", eos_id=big_eos, docs_end_with_eos="yes",
                token_dtype="uint16")


def test_yes_with_limit_appends_only_inside_the_limit(tmp_path):
    prefix, docs = mixed_megatron(tmp_path)
    m = convert("megatron", prefix, tmp_path / "out", eos_id=9, docs_end_with_eos="yes", limit=4)
    _, records = read_stream(tmp_path / "out")
    assert_same_docs(records, [[5, 6, 9], [7, 9], [], [8, 9]])
    assert m.conversion["eos_check"]["eos_appended"] == 1


def test_npy_offsets_documents_ending_with_eos(tmp_path, rng):
    docs = [np.append(rng.integers(0, 999, size=n), 999) for n in rng.integers(1, 50, 40)]
    docs.insert(7, np.zeros(0, np.int64))  # an empty document is neutral
    np.save(tmp_path / "tokens.npy", np.concatenate(docs).astype(np.uint16))
    np.save(tmp_path / "offsets.npy", np.concatenate([[0], np.cumsum([len(d) for d in docs])]))
    m = convert("npy", tmp_path / "tokens.npy", tmp_path / "out", offsets=tmp_path / "offsets.npy",
                eos_id=999, shard_size="4KiB")
    _, records = read_stream(tmp_path / "out")
    assert_same_docs(records, docs)
    assert m.docs_end_with_eos and m.conversion["eos_check"]["empty_docs"] == 1
    assert m.conversion["split"] == "offsets"
    for packing in ("concat", "bestfit"):
        batches = one_pass(str(tmp_path / "out"), packing, "stream")
        assert doubled_eos(batches, 999) == 0
        assert_pieces_are_documents(batches, str(tmp_path / "out"), docs)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_row_formats_detect_eos(tmp_path, rng, fmt):
    docs = [np.append(rng.integers(3, 500, size=n), 2) for n in rng.integers(1, 30, 25)]
    path = tmp_path / f"rows.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, docs)
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"input_ids": [d.tolist() for d in docs]}), path)
    m = convert(fmt, path, tmp_path / "out", eos_id=2)
    _, records = read_stream(tmp_path / "out")
    assert_same_docs(records, docs)
    assert m.docs_end_with_eos and m.conversion["eos_check"]["decided_by"] == "detected"
    batches = one_pass(str(tmp_path / "out"), "pad", "document")
    assert doubled_eos(batches, 2) == 0
    assert_pieces_are_documents(batches, str(tmp_path / "out"), docs)


def test_flat_eos_split_rules(tmp_path):
    np.array([5, 6, 0, 7, 0, 8, 9], np.uint16).tofile(tmp_path / "train.bin")
    m = convert("flat", tmp_path / "train.bin", tmp_path / "auto", eos_id=0)
    _, records = read_stream(tmp_path / "auto")
    assert_same_docs(records, [[5, 6, 0], [7, 0], [8, 9]])  # the tail is kept as it is
    assert m.docs_end_with_eos
    assert m.conversion["eos_check"] == {
        "requested": "auto", "eos_id": 0, "decided_by": "split_at_eos", "docs_with_eos": 2,
        "docs_without_eos": 1, "empty_docs": 0, "eos_appended": 0,
    }
    assert describe(m) == (
        "yes (split after each EOS id 0; the final document has none; the pipeline appends none)"
    )

    m = convert("flat", tmp_path / "train.bin", tmp_path / "yes", eos_id=0, docs_end_with_eos="yes")
    _, records = read_stream(tmp_path / "yes")
    assert_same_docs(records, [[5, 6, 0], [7, 0], [8, 9, 0]])
    assert m.conversion["eos_check"]["eos_appended"] == 1

    with pytest.raises(ConfigError, match="split after each EOS id 0"):
        convert("flat", tmp_path / "train.bin", tmp_path / "no", eos_id=0, docs_end_with_eos="no")
    with pytest.raises(ConfigError, match="docs_end_with_eos must be one of"):
        convert("flat", tmp_path / "train.bin", tmp_path / "bad", eos_id=0, docs_end_with_eos="maybe")

    # nanoGPT files end every document with EOS (the file ends with one): no tail at all.
    np.array([5, 6, 0, 7, 0], np.uint16).tofile(tmp_path / "owt.bin")
    m = convert("flat", tmp_path / "owt.bin", tmp_path / "owt", eos_id=0)
    assert m.conversion["eos_check"]["docs_without_eos"] == 0 and describe(m).startswith(
        "yes (split after each EOS id 0; the pipeline"
    )


def test_manifest_written_before_the_eos_check_reads_as_before(eod_stream, tmp_path, capsys):
    """An older manifest: no ``eos_check``, ``docs_end_with_eos: false``. It loads, keeps its
    fingerprint, and the pipeline appends EOS to its documents as it always did."""
    _, url, docs = eod_stream
    old = tmp_path / "old"
    shutil.copytree(url, old)
    data = json.loads((old / MANIFEST_NAME).read_text())
    del data["conversion"]["eos_check"]
    data["docs_end_with_eos"] = False
    (old / MANIFEST_NAME).write_text(json.dumps(data))

    manifest = Manifest.load(str(old))
    assert not manifest.docs_end_with_eos and "eos_check" not in manifest.conversion
    assert Manifest.loads(manifest.dumps()).dumps() == manifest.dumps()
    assert describe(manifest) == (
        "no (as recorded in the manifest; the pipeline appends EOS to every document)"
    )
    batches = one_pass(str(old), "concat", "document")
    assert_pieces_are_documents(batches, str(old), docs, eos=EOS)
    assert doubled_eos(batches, EOS) > 0

    # Without docs_end_with_eos at all (the oldest manifests), the default is false.
    del data["docs_end_with_eos"]
    (old / MANIFEST_NAME).write_text(json.dumps(data))
    assert not Manifest.load(str(old)).docs_end_with_eos

    assert main(["inspect", str(old)]) == 0
    assert "documents end with EOS: no (as recorded in the manifest" in capsys.readouterr().out


def test_cli_flag_and_inspect(tmp_path, capsys):
    prefix, _ = mixed_megatron(tmp_path)
    base = ["convert", "--from", "megatron", "--input", f"{prefix}.idx", "--eos-id", "9"]
    assert main([*base, "--output", str(tmp_path / "auto")]) == 2
    err = capsys.readouterr().err
    assert str(prefix) in err and "--docs-end-with-eos yes" in err

    assert main([*base, "--output", str(tmp_path / "yes"), "--docs-end-with-eos", "yes"]) == 0
    assert "documents end with EOS: yes (--docs-end-with-eos yes" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "yes")]) == 0
    out = capsys.readouterr().out
    assert "eos id       9" in out
    assert "documents end with EOS: yes (--docs-end-with-eos yes; EOS appended at conversion to 2" in out

    sequences, doc_idx, _ = eod_corpus(np.random.default_rng(0), 20)
    eod = write_megatron(tmp_path / "eod", sequences, doc_idx)
    args = ["convert", "--from", "megatron", "--input", str(eod), "--eos-id", str(EOS)]
    assert main([*args, "--output", str(tmp_path / "eod_out")]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "eod_out")]) == 0
    assert "documents end with EOS: yes (detected: all 20 non-empty documents end with EOS id " \
        f"{EOS}; the pipeline appends none)" in capsys.readouterr().out


# -- the decision rule, on random Megatron layouts ------------------------------------------

doc_st = st.tuples(
    st.lists(st.integers(0, 6), min_size=0, max_size=3),  # sentence lengths (0: empty)
    st.booleans(),  # ends with EOS
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs_spec=st.lists(doc_st, min_size=1, max_size=25), seed=st.integers(0, 99),
       gap=st.booleans())
def test_detection_matches_the_rule(docs_spec, seed, gap):
    rng = np.random.default_rng(seed)
    eos = 3
    sequences, doc_idx, docs = [], [0], []
    for sentence_lengths, ends in docs_spec:
        sentences = [rng.integers(4, 100, size=n).astype(np.uint16) for n in sentence_lengths]
        if ends:  # ids are 4..99, so only an appended EOS ends a document with one
            sentences = sentences or [np.zeros(0, np.uint16)]
            sentences[-1] = np.append(sentences[-1], eos).astype(np.uint16)
        if gap:  # an empty sentence after the last token must not hide the document end
            sentences.append(np.zeros(0, np.uint16))
        sequences += sentences
        doc_idx.append(len(sequences))
        docs.append(np.concatenate(sentences) if sentences else np.zeros(0, np.uint16))
    nonempty = [len(d) > 0 for d in docs]
    ending = [len(d) > 0 and d[-1] == eos for d in docs]
    tmp = tempfile.mkdtemp()
    try:
        prefix = write_megatron(f"{tmp}/c", sequences, doc_idx)
        source = open_source("megatron", prefix, eos_id=eos)
        got_nonempty, got_ends = source.ends_with(eos, len(docs))
        assert got_nonempty.tolist() == nonempty and got_ends.tolist() == ending
        n_with, n_without = sum(ending), sum(nonempty) - sum(ending)
        if n_with and n_without:
            with pytest.raises(SourceError, match="--docs-end-with-eos yes"):
                decide(source, len(docs), "auto")
        else:
            decision = decide(source, len(docs), "auto")
            assert decision.docs_end_with_eos == (n_without == 0 and n_with > 0)
        if sum(nonempty) == 0:
            return
        convert("megatron", prefix, f"{tmp}/yes", eos_id=eos, docs_end_with_eos="yes",
                shard_size="1KiB", frame_size="1KiB")
        manifest, records = read_stream(f"{tmp}/yes")
        assert manifest.docs_end_with_eos
        assert_same_docs(records, [np.append(d, eos) if n and not e else d
                                   for d, n, e in zip(docs, nonempty, ending)])
    finally:
        shutil.rmtree(tmp)


def test_jsonl_yes_with_workers_matches_one_worker(tmp_path, rng):
    docs = [rng.integers(3, 500, size=n) for n in rng.integers(0, 200, 120)]
    docs = [np.append(d, 2) if i % 3 == 0 and len(d) else d for i, d in enumerate(docs)]
    write_jsonl(tmp_path / "rows.jsonl", docs)
    with pytest.raises(SourceError, match="rows.jsonl"):
        convert("jsonl", tmp_path / "rows.jsonl", tmp_path / "auto", eos_id=2)
    for workers in (1, 2):
        convert("jsonl", tmp_path / "rows.jsonl", tmp_path / f"w{workers}", eos_id=2,
                docs_end_with_eos="yes", workers=workers, shard_size="2KiB")
    assert (tmp_path / "w1" / MANIFEST_NAME).read_bytes() == (tmp_path / "w2" / MANIFEST_NAME).read_bytes()
    manifest, records = read_stream(tmp_path / "w2")
    assert manifest.num_shards > 2 and manifest.docs_end_with_eos
    assert_same_docs(records, [d if len(d) == 0 or d[-1] == 2 else np.append(d, 2) for d in docs])
