"""The stream manifest, ``index.json``.

Opening a stream reads this one file: no bucket listing, no per-shard request. The shard
table is stored column-wise (one JSON list per field) because a list of 100k small objects
parses several times slower than a few lists of 100k numbers.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import ConfigError, ManifestError, ShardCorruptError, StorageError
from ..storage.config import RetryPolicy
from ..storage.open import describe_missing, join, open_url
from ..storage.retry import Retrier, is_credentials_error
from .checks import check_header, check_rows, shard_table, show_value

FORMAT_NAME = "streamforge"
FORMAT_VERSION = 1
MANIFEST_NAME = "index.json"
TOKEN_DTYPES = ("uint16", "uint32")

_INT_COLUMNS = ("bytes", "num_records", "num_tokens", "num_frames", "index_offset", "index_bytes")
# optional columns: a manifest written before them loads without them
_OPTIONAL_COLUMNS = ("num_docs",)  # non-empty records per shard (what the job clock counts)


# A shard file is ``shard-NNNNNN.tar.zst`` (``.tar`` uncompressed) in the first generation
# written to a prefix, and ``shard-NNNNNN.gG.tar.zst`` (G >= 1) when a conversion replaces a
# stream: new shards never take a name the live manifest lists (docs/convert.md).
SHARD_NAME_RE = re.compile(r"^shard-(\d{6,})(?:\.g([1-9]\d*))?\.tar(?:\.zst)?$")


def shard_name(shard: int, compressed: bool = True, generation: int = 0) -> str:
    tag = f".g{generation}" if generation else ""
    return f"shard-{shard:06d}{tag}.tar" + (".zst" if compressed else "")


def shard_generation(name: str) -> int:
    """The generation of a writer-made shard name (0 untagged); -1 for any other name."""
    match = SHARD_NAME_RE.match(name)
    return -1 if match is None else int(match.group(2) or 0)


def _untagged(name: str) -> str:
    """``name`` without its generation tag: the fingerprint of a rewritten stream of the same
    content stays the same."""
    match = SHARD_NAME_RE.match(name)
    return name if match is None or not match.group(2) else name.replace(f".g{match.group(2)}.", ".", 1)


@dataclass(frozen=True)
class ShardInfo:
    """One row of the shard table (``Manifest.shards``).

    Args:
        name: the shard's file name inside the stream's prefix.
        bytes: the shard file's size; ``sha256``: its digest.
        num_records, num_tokens, num_frames: what the shard holds.
        index_offset, index_bytes: where its record index lies (at its end).
        first_record: the stream-wide index of its first record.
        num_docs: its non-empty records (None for a manifest written before the column).
    """

    name: str
    bytes: int
    sha256: str
    num_records: int
    num_tokens: int
    num_frames: int
    index_offset: int
    index_bytes: int
    first_record: int
    num_docs: int | None = None  # None: a manifest written before the column


@dataclass(frozen=True, eq=False)
class Manifest:
    """A stream's manifest: dtype, special tokens, shard table, totals, provenance.

    Built by ``Manifest.load`` (reading ``index.json``) or by a writer; docs/format.md lists
    every field.

    Args:
        token_dtype: ``"uint16"`` or ``"uint32"``, the dtype of every token.
        shard_names: each shard's file name, relative to the stream's prefix.
        shard_sha256: each shard file's SHA-256, hex.
        columns: the shard table's integer columns, int64 arrays of one entry per shard.
        eos_id: the end-of-document token id, or None.
        vocab_size: the vocabulary size, or None.
        docs_end_with_eos: every document already ends with ``eos_id``.
        conversion: how the stream was written (sizes, converter, source format...).
        source_fingerprint: an identifier of the converter's input, or None.
        compression: the frame codec of every shard: ``"zstd"`` or ``"none"`` (plain .tar).
        tokenizer: the tokenizer of a stream converted from text, or None.
        url: where it was loaded from; never part of the fingerprint.
    """

    token_dtype: str
    shard_names: list[str]
    shard_sha256: list[str]
    columns: dict[str, np.ndarray]  # _INT_COLUMNS -> int64 arrays, one entry per shard
    eos_id: int | None = None
    vocab_size: int | None = None
    docs_end_with_eos: bool = False
    conversion: dict[str, Any] = field(default_factory=dict)
    source_fingerprint: str | None = None
    compression: str = "zstd"  # frame codec of every shard: "zstd" or "none" (plain .tar)
    # The tokenizer of a stream converted from text (kind, name, sha256, vocab_size, eos_id);
    # None for streams converted from token ids. Written only when set, so manifests without
    # it keep their bytes.
    tokenizer: dict[str, Any] | None = None
    url: str | None = None  # where it was loaded from; never part of the fingerprint

    # -- totals ---------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return len(self.shard_names)

    @property
    def num_records(self) -> int:
        return int(self.columns["num_records"].sum())

    @property
    def num_tokens(self) -> int:
        return int(self.columns["num_tokens"].sum())

    @property
    def num_bytes(self) -> int:
        return int(self.columns["bytes"].sum())

    @cached_property
    def first_records(self) -> np.ndarray:
        """Stream-wide index of each shard's first record."""
        counts = self.columns["num_records"]
        return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)

    @cached_property
    def shards(self) -> list[ShardInfo]:
        c = self.columns
        return [
            ShardInfo(
                name=self.shard_names[i],
                sha256=self.shard_sha256[i],
                first_record=int(self.first_records[i]),
                **{k: int(c[k][i]) for k in _INT_COLUMNS},
                **{k: int(c[k][i]) for k in _OPTIONAL_COLUMNS if k in c},
            )
            for i in range(self.num_shards)
        ]

    @cached_property
    def fingerprint(self) -> str:
        """A digest of the stream's content: dtype, special tokens and every shard's hash.

        It never includes the URL, so the same corpus copied elsewhere has the same one.
        """
        h = hashlib.sha256()
        head = [self.token_dtype, self.eos_id, self.docs_end_with_eos, self.num_shards]
        h.update(json.dumps(head).encode())
        rows = zip(self.shard_names, self.shard_sha256, self.columns["num_records"].tolist())
        h.update("".join(f"{_untagged(name)}:{digest}:{n};" for name, digest, n in rows).encode())
        return h.hexdigest()[:32]

    # -- (de)serialization ----------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        shards: dict[str, Any] = {"name": self.shard_names, "sha256": self.shard_sha256}
        shards.update({k: self.columns[k].tolist() for k in (*_INT_COLUMNS, *_OPTIONAL_COLUMNS) if k in self.columns})
        out = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "token_dtype": self.token_dtype,
            "compression": self.compression,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "docs_end_with_eos": self.docs_end_with_eos,
            "num_shards": self.num_shards,
            "num_records": self.num_records,
            "num_tokens": self.num_tokens,
            "num_bytes": self.num_bytes,
            "shards": shards,
            "conversion": self.conversion,
            "source_fingerprint": self.source_fingerprint,
        }
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer
        return out

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: dict[str, Any], url: str | None = None) -> Manifest:
        where = url or "manifest"
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not a {FORMAT_NAME} manifest")
        if data.get("version") != FORMAT_VERSION:
            raise ManifestError(
                f"{where}: format version {data.get('version')!r}, this streamforge reads "
                f"version {FORMAT_VERSION}"
            )
        # Nothing in the file is trusted: checks.py bounds every value and names the field.
        token_dtype = data.get("token_dtype")
        if data.get("compression", "zstd") not in ("zstd", "none"):
            raise ManifestError(f"{where}: unknown compression {show_value(data.get('compression'))}")
        if token_dtype not in TOKEN_DTYPES:
            raise ManifestError(f"{where}: token_dtype {show_value(token_dtype)} not in {TOKEN_DTYPES}")
        check_header(data, where)
        names, digests, columns = shard_table(data.get("shards"), _INT_COLUMNS, _OPTIONAL_COLUMNS, where)
        check_rows(columns, names, np.dtype(token_dtype).itemsize, data.get("compression", "zstd"), where)
        manifest = cls(
            token_dtype=token_dtype,
            shard_names=names,
            shard_sha256=digests,
            columns=columns,
            eos_id=data.get("eos_id"),
            vocab_size=data.get("vocab_size"),
            docs_end_with_eos=bool(data.get("docs_end_with_eos", False)),
            conversion=data.get("conversion") or {},
            source_fingerprint=data.get("source_fingerprint"),
            compression=data.get("compression", "zstd"),
            tokenizer=data.get("tokenizer"),
            url=url,
        )
        for key in ("num_shards", "num_records", "num_tokens", "num_bytes"):
            if key in data and data[key] != getattr(manifest, key):
                raise ManifestError(
                    f"{where}: {key} says {data[key]}, the shard table sums to "
                    f"{getattr(manifest, key)}"
                )
        return manifest

    @classmethod
    def loads(cls, blob: bytes, url: str | None = None) -> Manifest:
        try:
            data = json.loads(blob)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
            raise ManifestError(f"{url or 'manifest'}: not valid JSON ({exc})") from exc
        return cls.from_json(data, url)

    @classmethod
    def load(
        cls,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        client: str = "auto",
    ) -> Manifest:
        """Read ``<url>/index.json``: one request (retried on transient faults), no listing.

        What is wrong before training starts gets a ``ManifestError`` naming it: a missing
        bucket, a missing manifest, missing or refused credentials, another format version.
        Transient faults that outlast the retries raise ``StorageError``.
        """
        url = str(url)
        policy = retry or RetryPolicy()
        try:
            fs, path = open_url(url, storage_options, policy, client)
        except ConfigError:
            raise
        except (ImportError, ValueError, TypeError) as exc:
            raise ManifestError(f"{url}: cannot open this URL ({type(exc).__name__}: {exc})") from exc
        target = join(path, MANIFEST_NAME)
        try:
            blob = Retrier(policy)(lambda: fs.cat_file(target), f"{url}/{MANIFEST_NAME}")
        except FileNotFoundError as exc:
            raise ManifestError(describe_missing(fs, path, url, MANIFEST_NAME)) from exc
        except PermissionError as exc:
            raise ManifestError(
                f"{url}: access denied reading {MANIFEST_NAME} ({exc}); check the credentials "
                "in storage_options (key/secret, profile, token) or the bucket's policy"
            ) from exc
        except ShardCorruptError as exc:  # not a regular file (storage/local.py)
            raise ManifestError(f"{url}: cannot read {MANIFEST_NAME}: {exc}") from exc
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - credential errors come as library types
            if is_credentials_error(exc):
                raise ManifestError(
                    f"{url}: no usable credentials ({type(exc).__name__}: {exc}); pass them in "
                    "storage_options (key/secret or profile), set them in the environment, or "
                    "use anon=True for a public bucket"
                ) from exc
            raise
        return cls.loads(blob, url)

    def token_np_dtype(self) -> np.dtype:
        return np.dtype(self.token_dtype).newbyteorder("<")


def check_stream(
    url: str, storage_options: dict[str, Any] | None = None, policy: RetryPolicy | None = None
) -> Manifest:
    """Load the manifest at ``url``, raising a clear ``ManifestError`` for what is wrong.

    Missing bucket, missing manifest, missing or refused credentials, a manifest of another
    format version: each is named before training starts. Returns the ``Manifest``.
    """
    manifest = Manifest.load(url, storage_options, retry=policy or RetryPolicy())
    if manifest.num_shards == 0:
        raise ManifestError(f"{url}: the manifest lists no shards")
    return manifest
