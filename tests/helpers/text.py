"""Text corpora and tokenizers for the text-conversion tests, all made offline in the test.

``train_hf`` trains a small byte-level BPE with ``tokenizers``; ``train_sentencepiece``
trains a small unigram model; ``write_tiktoken`` writes a BPE rank file (every byte, then
frequent byte pairs of the corpus). Nothing is downloaded.
"""

from __future__ import annotations

import base64
import collections
import io
import json

import numpy as np

WORDS = (
    "the quick brown fox jumps over lazy dog stream shard token frame record über naïve "
    "données 日本語 テキスト emoji 🙂 code def return {} [] () == != <= >= \t tab"
).split(" ")


def make_docs(rng: np.random.Generator, num_docs: int, max_words: int = 80) -> list[str]:
    """Documents of random words; about one in twenty is empty."""
    docs = []
    for _ in range(num_docs):
        n = 0 if rng.random() < 0.05 else int(rng.integers(1, max_words))
        docs.append(" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n)))
    return docs


def train_hf(path, docs: list[str], vocab_size: int = 330) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    tok.save(str(path))
    return str(path)


def train_sentencepiece(path, docs: list[str], vocab_size: int = 330) -> str:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([d for d in docs if d]), model_writer=model, vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, byte_fallback=True, minloglevel=2,
        num_threads=1, hard_vocab_limit=False,
    )
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return str(path)


TIKTOKEN_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def write_tiktoken(path, docs: list[str], merges: int = 200, extra_ranks: int = 0) -> str:
    """Every single byte, then the ``merges`` most frequent byte pairs, then ``extra_ranks``
    filler tokens (three-byte sequences that never occur) to widen the vocabulary."""
    pairs = collections.Counter()
    for doc in docs:
        data = doc.encode()
        pairs.update(data[i : i + 2] for i in range(len(data) - 1))
    tokens = [bytes([b]) for b in range(256)] + [p for p, _ in pairs.most_common(merges)]
    tokens += [b"\xff\xfe" + i.to_bytes(4, "little") for i in range(extra_ranks)]
    with open(path, "wb") as f:
        for rank, token in enumerate(tokens):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    return str(path)


def write_text_jsonl(path, docs: list[str], field: str = "text", open_fn=open) -> str:
    with open_fn(str(path), "wt", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, field: doc}) + "\n")
    return str(path)


def write_text_parquet(path, docs: list, field: str = "text", row_group_size: int = 100, binary=False):
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = pa.binary() if binary else pa.string()
    table = pa.table({"id": list(range(len(docs))), field: pa.array(docs, type=kind)})
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def split_files(directory, docs: list[str], num_files: int, suffix: str = ".jsonl") -> list[str]:
    """``docs`` over ``num_files`` jsonl files ``part-NNNN<suffix>`` (gzip/zstd by suffix)."""
    import fsspec

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, chunk in enumerate(np.array_split(np.arange(len(docs)), num_files)):
        path = directory / f"part-{k:04d}{suffix}"
        with fsspec.open(str(path), "wt", compression="infer", encoding="utf-8") as f:
            for i in chunk.tolist():
                f.write(json.dumps({"id": i, "text": docs[i]}) + "\n")
        paths.append(str(path))
    return paths


def tree_digests(fs, root: str) -> dict[str, bytes]:
    """Every file under ``root`` (relative name -> bytes)."""
    return {
        p[len(root.rstrip("/")) + 1 :]: fs.cat_file(p) for p in sorted(fs.find(root))
    }
