"""Tokenizers for text conversion: a Hugging Face ``tokenizer.json``, a tiktoken BPE file with
its pattern, or a sentencepiece ``.model``; read from a local or fsspec path, never a hub.

The driver reads the file once (``load_tokenizer``): its sha256, vocabulary size and EOS id go
into the manifest, and its bytes travel with the tasks, so cluster nodes need no copy of it.
Each task builds the encoder from those bytes (``encoder_for``, cached per process) and
encodes one batch of documents per call, single-threaded: one task is one core.

Every non-empty document gets the EOS id appended, unless the tokenizer already ends each
encoding with it (a ``tokenizer.json`` whose post-processor appends EOS); an empty text stays
a zero-token record.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError

KINDS = ("hf", "tiktoken", "sentencepiece")
# EOS tokens looked up by name in a tokenizer.json when neither --eos-token nor --eos-id says.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
TIKTOKEN_EOS = "<|endoftext|>"


def _kind_from_name(path: str) -> str:
    name = path.lower()
    if name.endswith(".json"):
        return "hf"
    if name.endswith(".model"):
        return "sentencepiece"
    if name.endswith((".tiktoken", ".bpe")):
        return "tiktoken"
    raise ConfigError(
        f"{path}: cannot tell the tokenizer kind from the file name; pass tokenizer_kind= "
        f"(--tokenizer-kind) as one of {', '.join(KINDS)}"
    )


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer file and what the manifest records about it; picklable."""

    kind: str
    name: str
    sha256: str
    vocab_size: int
    eos_id: int
    eos_token: str | None
    appends_eos: bool  # the tokenizer itself ends every non-empty encoding with EOS
    pattern: str | None = None  # tiktoken's split pattern
    data: bytes = field(default=b"", repr=False)

    def record(self) -> dict[str, Any]:
        """The manifest's ``tokenizer`` entry."""
        out = {
            "kind": self.kind,
            "name": self.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
            "appends_eos": self.appends_eos,
        }
        if self.pattern is not None:
            out["pattern"] = self.pattern
        return out


def load_tokenizer(
    path: str,
    *,
    kind: str | None = None,
    pattern: str | None = None,
    eos_token: str | None = None,
    eos_id: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> TokenizerSpec:
    """Read and check the tokenizer at ``path``; ConfigError naming the file if unusable."""
    import fsspec

    path = str(path)
    kind = kind or _kind_from_name(path)
    if kind not in KINDS:
        raise ConfigError(f"tokenizer kind must be one of {', '.join(KINDS)}, got {kind!r}")
    try:
        with fsspec.open(path, "rb", **(storage_options or {})) as f:
            data = f.read()
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: tokenizer file not found") from exc
    if kind == "tiktoken" and not pattern:
        raise ConfigError(f"{path}: a tiktoken BPE file needs its split pattern (--tiktoken-pattern)")
    if kind != "tiktoken" and pattern:
        raise ConfigError(f"{path}: --tiktoken-pattern applies to tiktoken files only, not {kind}")
    draft = TokenizerSpec(
        kind=kind, name=os.path.basename(path.rstrip("/")), sha256=hashlib.sha256(data).hexdigest(),
        vocab_size=0, eos_id=-1 if eos_id is None else int(eos_id), eos_token=eos_token,
        appends_eos=False, pattern=pattern, data=data,
    )
    try:
        encoder = _build(draft)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - each library raises its own types for a bad file
        raise ConfigError(f"{path}: not a usable {kind} tokenizer ({type(exc).__name__}: {exc})") from exc
    spec = encoder.spec
    if not 0 <= spec.eos_id < spec.vocab_size:
        raise ConfigError(f"{path}: EOS id {spec.eos_id} is outside the vocabulary of {spec.vocab_size}")
    return spec


class _Encoder:
    """Turns a batch of texts into (flat tokens, int64 offsets), EOS appended where needed."""

    spec: TokenizerSpec

    def ids(self, texts: list[str]) -> list[list[int]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def encode(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        ids = self.ids(texts) if texts else []
        lengths = np.fromiter((len(x) for x in ids), np.int64, len(ids))
        add = (not self.spec.appends_eos) & (lengths > 0)
        total = int(lengths.sum() + add.sum())
        flat = np.empty(total, dtype)
        offsets = np.zeros(len(ids) + 1, np.int64)
        np.cumsum(lengths + add, out=offsets[1:])
        if add.all():  # the common case: one EOS after each document, flattened in C
            eos = self.spec.eos_id
            for doc in ids:
                doc.append(eos)
            flat[:] = np.fromiter(itertools.chain.from_iterable(ids), dtype, total)
        else:
            for i, doc in enumerate(ids):
                lo = int(offsets[i])
                flat[lo : lo + len(doc)] = doc
                if add[i]:
                    flat[lo + len(doc)] = self.spec.eos_id
        return flat, offsets


class _HF(_Encoder):
    def __init__(self, spec: TokenizerSpec) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(spec.data.decode("utf-8"))
        vocab = self.tok.get_vocab_size(with_added_tokens=True)
        eos_id, eos_token = spec.eos_id, spec.eos_token
        if eos_id < 0:
            names = [eos_token] if eos_token else list(EOS_CANDIDATES)
            found = [(n, self.tok.token_to_id(n)) for n in names]
            found = [(n, i) for n, i in found if i is not None]
            if not found:
                raise ConfigError(
                    f"{spec.name}: no EOS token ({', '.join(names)}) in this tokenizer; pass "
                    "--eos-token NAME or --eos-id ID"
                )
            eos_token, eos_id = found[0]
        elif eos_token is None:
            eos_token = self.tok.id_to_token(eos_id)
        probe = self.tok.encode("a").ids
        appends = bool(probe) and probe[-1] == eos_id
        self.spec = _replace(spec, vocab_size=vocab, eos_id=eos_id, eos_token=eos_token, appends_eos=appends)
        self._batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)

    def ids(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._batch(texts)]


class _Tiktoken(_Encoder):
    def __init__(self, spec: TokenizerSpec) -> None:
        import tiktoken

        ranks = parse_tiktoken_bpe(spec.data, spec.name)
        eos_token = spec.eos_token or TIKTOKEN_EOS
        eos_id = spec.eos_id if spec.eos_id >= 0 else max(ranks.values()) + 1
        if eos_id in ranks.values():
            raise ConfigError(f"{spec.name}: EOS id {eos_id} is already the rank of a BPE token")
        self.enc = tiktoken.Encoding(
            name=f"streamforge-{spec.sha256[:12]}", pat_str=spec.pattern,
            mergeable_ranks=ranks, special_tokens={eos_token: eos_id},
        )
        self.spec = _replace(spec, vocab_size=self.enc.n_vocab, eos_id=eos_id, eos_token=eos_token, appends_eos=False)

    def ids(self, texts: list[str]) -> list[list[int]]:
        # Ordinary encoding: a literal "<|endoftext|>" in a document is text, never EOS.
        return self.enc.encode_ordinary_batch(texts, num_threads=1)


class _SentencePiece(_Encoder):
    def __init__(self, spec: TokenizerSpec) -> None:
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_proto=spec.data)
        eos_id, eos_token = spec.eos_id, spec.eos_token
        if eos_id < 0 and eos_token:
            eos_id = self.sp.piece_to_id(eos_token)
            if eos_id == self.sp.unk_id() and eos_token != self.sp.id_to_piece(eos_id):
                raise ConfigError(f"{spec.name}: no piece {eos_token!r} in this model")
        if eos_id < 0:
            eos_id = self.sp.eos_id()
            if eos_id < 0:
                raise ConfigError(f"{spec.name}: this model defines no EOS; pass --eos-token or --eos-id")
        eos_token = eos_token or self.sp.id_to_piece(eos_id)
        self.spec = _replace(
            spec, vocab_size=self.sp.get_piece_size(), eos_id=eos_id, eos_token=eos_token, appends_eos=False
        )

    def ids(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=1)


def _replace(spec: TokenizerSpec, **changes: Any) -> TokenizerSpec:
    from dataclasses import replace

    return replace(spec, **changes)


def parse_tiktoken_bpe(data: bytes, where: str) -> dict[bytes, int]:
    """A tiktoken BPE file: one ``base64(token) rank`` per line."""
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise ConfigError(f"{where}:{line_no}: expected 'base64-token rank', found {line[:60]!r}") from exc
    if not ranks:
        raise ConfigError(f"{where}: no BPE ranks in this file")
    return ranks


_BUILDERS = {"hf": _HF, "tiktoken": _Tiktoken, "sentencepiece": _SentencePiece}
_CACHE: dict[str, _Encoder] = {}


def _build(spec: TokenizerSpec) -> _Encoder:
    return _BUILDERS[spec.kind](spec)


def encoder_for(spec: TokenizerSpec) -> _Encoder:
    """The encoder of ``spec``, built once per process; single-threaded."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task is one core
    key = spec.sha256 + repr((spec.eos_id, spec.eos_token, spec.pattern))
    if key not in _CACHE:
        _CACHE[key] = _build(spec)
    return _CACHE[key]
