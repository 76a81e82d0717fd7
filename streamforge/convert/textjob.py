"""The two tasks of a text conversion, each run once per slice on any engine.

``scan_slice`` reads a slice without tokenizing it: it counts the valid documents, lists the
bad rows, hashes the texts and places the slice's shard boundaries from each document's UTF-8
size (``BYTES_PER_TOKEN`` bytes per token, plus the EOS). Reading and hashing run at hundreds
of MB/s, a small cost beside tokenizing, and it means every record index and every shard
number of the stream is known before the first document is tokenized.

``write_slice`` reads the slice again, tokenizes the documents of each shard it owns and
writes the shard straight to the destination, then a receipt (the shard's manifest row) under
``_convert-state/``. Shards never span two slices, so a slice's shards depend on that slice
alone: any engine, any number of workers, any order of tasks writes the same bytes. On a
rerun, a shard whose receipt matches the file's size and sha256 is kept and its documents are
not tokenized again; a slice whose shards all verify is not read at all.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import SourceError
from ..format.manifest import shard_name
from ..format.tar import records_nbytes
from ..format.writer import cut_points, encode_shard_flat, write_shard
from ..storage.open import join, open_url
from .text import Slice, documents
from .tokenizer import TokenizerSpec, encoder_for

BYTES_PER_TOKEN = 4  # shard boundaries are placed from text sizes at this many bytes per token
ENCODE_BATCH = 512  # documents per tokenizer call
STATE_DIR = "_convert-state"


@dataclass(frozen=True)
class ScanTask:
    piece: Slice
    field: str
    on_bad_row: str
    storage_options: dict[str, Any] | None
    shard_size: int
    itemsize: int


@dataclass(frozen=True)
class SliceScan:
    index: int
    num_docs: int
    shard_starts: list[int]  # first document (within the slice) of each shard
    digest: str
    skipped: list[str]
    text_bytes: int


class _Digest:
    """sha256 over the documents of a slice (each with its length) and its bad rows."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.num_docs = 0

    def add(self, data: bytes) -> None:
        self.h.update(len(data).to_bytes(8, "little"))
        self.h.update(data)
        self.num_docs += 1

    def finish(self, skipped: list[str]) -> str:
        for line in skipped:
            self.h.update(b"\x00skip:" + line.encode("utf-8", "replace"))
        return self.h.hexdigest()


def shard_layout(text_bytes: np.ndarray, shard_size: int, itemsize: int) -> list[int]:
    """Shard starts from the documents' UTF-8 sizes: a pure function of the slice's texts."""
    if not len(text_bytes):
        return []
    tokens = -(-np.asarray(text_bytes, np.int64) // BYTES_PER_TOKEN) + (np.asarray(text_bytes) > 0)
    return cut_points(records_nbytes(tokens, itemsize), shard_size)


def scan_slice(task: ScanTask, _shared: Any = None) -> SliceScan:
    skipped: list[str] = []
    digest = _Digest()
    sizes: list[int] = []
    for text in documents(task.piece, task.field, task.on_bad_row, skipped.append, task.storage_options):
        data = text.encode("utf-8")
        digest.add(data)
        sizes.append(len(data))
    text_bytes = np.asarray(sizes, np.int64)
    return SliceScan(
        index=task.piece.index,
        num_docs=digest.num_docs,
        shard_starts=shard_layout(text_bytes, task.shard_size, task.itemsize),
        digest=digest.finish(skipped),
        skipped=skipped,
        text_bytes=int(text_bytes.sum()),
    )


@dataclass(frozen=True)
class WriteTask:
    piece: Slice
    scan: SliceScan
    field: str
    on_bad_row: str
    input_options: dict[str, Any] | None
    url: str
    storage_options: dict[str, Any] | None
    token_dtype: str
    frame_size: int
    compression_level: int
    compression: str
    first_record: int
    first_shard: int
    receipts: dict[int, dict[str, Any]] = field(default_factory=dict)  # shard -> row
    generation: int = 0  # of the shard names written (``writer.next_generation``)


@dataclass(frozen=True)
class SliceDone:
    index: int
    rows: list[dict[str, Any]]  # manifest rows of the slice's shards, in order
    num_docs: int
    num_tokens: int
    kept: int  # shards verified and kept from an earlier run


def receipt_path(path: str, shard: int, compression: str) -> str:
    return join(join(path, STATE_DIR), shard_name(shard, compression != "none") + ".json")


def _verified(fs, path: str, row: dict[str, Any]) -> bool:
    """Does the shard file match its receipt (size, then sha256 of its bytes)?"""
    target = join(path, row["name"])
    try:
        if fs.size(target) != row["bytes"]:
            return False
        return hashlib.sha256(fs.cat_file(target)).hexdigest() == row["sha256"]
    except FileNotFoundError:
        return False


def write_slice(task: WriteTask, spec: TokenizerSpec) -> SliceDone:
    fs, path = open_url(task.url, task.storage_options)
    scan = task.scan
    bounds = scan.shard_starts + [scan.num_docs]
    count = len(scan.shard_starts)
    rows: dict[int, dict[str, Any]] = {}
    for shard, row in task.receipts.items():
        if _verified(fs, path, row):
            rows[shard] = row
    kept = len(rows)
    if kept == count:
        return SliceDone(scan.index, [rows[s] for s in sorted(rows)], scan.num_docs, _tokens(rows), kept)
    encoder = encoder_for(spec)
    dtype = np.dtype(task.token_dtype).newbyteorder("<")
    skipped: list[str] = []
    digest = _Digest()
    texts: list[str] = []
    local = 0  # shard of the slice being gathered
    for text in documents(task.piece, task.field, task.on_bad_row, skipped.append, task.input_options):
        digest.add(text.encode("utf-8"))
        if task.first_shard + local in rows:
            if digest.num_docs == bounds[local + 1]:
                local += 1
            continue
        texts.append(text)
        if digest.num_docs == bounds[local + 1]:
            shard = task.first_shard + local
            rows[shard] = _write(fs, path, task, spec, encoder, dtype, texts, bounds[local], shard)
            texts, local = [], local + 1
    if digest.num_docs != scan.num_docs or digest.finish(skipped) != scan.digest:
        raise SourceError(
            f"{task.piece.where}: changed while it was being converted ({digest.num_docs} documents "
            f"now, {scan.num_docs} when scanned); rerun the conversion"
        )
    return SliceDone(scan.index, [rows[s] for s in sorted(rows)], scan.num_docs, _tokens(rows), kept)


def _tokens(rows: dict[int, dict[str, Any]]) -> int:
    return sum(int(r["num_tokens"]) for r in rows.values())


def _write(fs, path, task: WriteTask, spec, encoder, dtype, texts, first_doc, shard) -> dict[str, Any]:
    """Tokenize one shard's documents, write the shard, then its receipt; its manifest row."""
    flats, offsets = [], [np.zeros(1, np.int64)]
    base = 0
    for lo in range(0, len(texts), ENCODE_BATCH):
        flat, off = encoder.encode(texts[lo : lo + ENCODE_BATCH], dtype)
        flats.append(flat)
        offsets.append(off[1:] + base)
        base += len(flat)
    tokens = np.concatenate(flats) if flats else np.zeros(0, dtype)
    encoded = encode_shard_flat(
        tokens, np.concatenate(offsets), task.first_record + first_doc,
        frame_size=task.frame_size, compression_level=task.compression_level,
        compression=task.compression,
    )
    try:
        row = write_shard(fs, path, shard, encoded, task.compression, task.generation)
        with fs.open(receipt_path(path, shard, task.compression), "wb") as out:
            out.write(json.dumps(row, sort_keys=True).encode())
    except OSError as exc:
        exc.add_note(f"while writing shard {shard} of {task.url} ({task.piece.where})")
        raise
    return row
