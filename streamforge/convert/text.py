"""Raw text in: the slices of a jsonl or parquet corpus and the documents of each slice.

A *slice* is the unit of work: one jsonl file (plain, ``.gz``, ``.zst``...; a compressed file
cannot be split) or one parquet row group. Slices are listed once, in sorted file order then
row-group order, so their order, and with it the order of records in the stream, is a
function of the input alone. Every file is opened through fsspec (local, ``s3://``,
``gs://``); a task reads its own slice straight from where it lives: a row group is read with
ranged requests, a jsonl file streamed line by line.

``documents(slice, field, on_bad_row)`` yields each valid document's text. A row whose field
is missing, not a string or not valid UTF-8 (undecodable bytes, a lone surrogate, a line that
is not JSON) is a *bad row*: under ``raise`` a ``SourceError`` naming the file and line (or
row), under ``skip`` it is left out and reported to ``skipped``, which the caller counts and
lists in the manifest.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import ConfigError, SourceError
from .jsonl import JSONL_SUFFIXES, PARQUET_SUFFIXES

BAD_ROW_POLICIES = ("raise", "skip")


@dataclass(frozen=True)
class Slice:
    """One unit of work: a jsonl file, or one row group of a parquet file."""

    index: int
    url: str
    row_group: int | None = None
    first_row: int = 0  # parquet: the file's row number of the group's first row

    @property
    def where(self) -> str:
        return self.url if self.row_group is None else f"{self.url} (row group {self.row_group})"


def _url(fs, path: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else fs.unstrip_protocol(path)


def list_files(fmt: str, input: str, storage_options: dict[str, Any] | None) -> list[str]:
    """The input files named by ``input`` (a file, a directory or a glob), sorted."""
    import fsspec

    suffixes = PARQUET_SUFFIXES if fmt == "parquet" else JSONL_SUFFIXES
    fs, root = fsspec.core.url_to_fs(str(input), **(storage_options or {}))
    if any(ch in root for ch in "*?["):
        found = fs.glob(root)
    elif fs.isdir(root):
        found = [p for p in fs.find(root) if p.endswith(suffixes)]
    elif fs.exists(root):
        found = [root]
    else:
        raise SourceError(f"{input}: {fmt} input not found")
    files = sorted(p for p in found if not fs.isdir(p))
    if not files:
        raise SourceError(f"{input}: no {fmt} files ({', '.join(suffixes)}) found")
    return [_url(fs, p) for p in files]


def list_slices(fmt: str, input: str, storage_options: dict[str, Any] | None) -> list[Slice]:
    """Every slice of the input, in stream order. Parquet costs one footer read per file."""
    files = list_files(fmt, input, storage_options)
    if fmt == "jsonl":
        return [Slice(i, url) for i, url in enumerate(files)]
    slices: list[Slice] = []
    for url in files:
        pf, f = _parquet_file(url, storage_options)
        with f:
            meta = pf.metadata
        first = 0
        for group in range(meta.num_row_groups):
            slices.append(Slice(len(slices), url, group, first))
            first += meta.row_group(group).num_rows
    return slices


def _parquet_file(url: str, storage_options: dict[str, Any] | None):
    import fsspec

    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("the parquet format needs pyarrow (pip install 'streamforge[parquet]')") from exc
    f = fsspec.open(url, "rb", **(storage_options or {})).open()
    try:
        return pq.ParquetFile(f), f
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for bad files
        f.close()
        raise SourceError(f"{url}: not a readable parquet file ({exc})") from exc


Skipped = Callable[[str], None]


def documents(
    piece: Slice, field: str, on_bad_row: str, skipped: Skipped, storage_options: dict[str, Any] | None
) -> Iterator[str]:
    """The valid documents of ``piece``, in order; bad rows raise or go to ``skipped``."""

    def bad(where: str, why: str) -> None:
        if on_bad_row == "raise":
            raise SourceError(f"{where}: {why} (pass --on-bad-row skip to skip such rows)")
        skipped(f"{where}: {why}")

    rows = _jsonl_rows(piece, field, storage_options) if piece.row_group is None else _parquet_rows(
        piece, field, storage_options
    )
    for where, text, why in rows:
        if why is None:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                why = "text is not valid UTF-8 (holds a lone surrogate)"
        if why is None:
            yield text
        else:
            bad(where, why)


def _jsonl_rows(piece: Slice, field: str, storage_options) -> Iterator[tuple[str, Any, str | None]]:
    import fsspec

    with fsspec.open(piece.url, "rb", compression="infer", **(storage_options or {})) as f:
        # zstandard's reader has no readline: a buffered reader gives lines for every codec
        for line_no, raw in enumerate(io.BufferedReader(f, 1 << 20), 1):
            if not raw.strip():
                continue
            where = f"{piece.url}:{line_no}"
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                yield where, None, f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})"
                continue
            except ValueError as exc:
                yield where, None, f"not valid JSON ({exc})"
                continue
            if not isinstance(obj, dict) or field not in obj:
                found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                yield where, None, f"no field {field!r} (found {found})"
            elif not isinstance(obj[field], str):
                yield where, None, f"field {field!r} is {type(obj[field]).__name__}, expected a string"
            else:
                yield where, obj[field], None


def _parquet_rows(piece: Slice, field: str, storage_options) -> Iterator[tuple[str, Any, str | None]]:
    import pyarrow as pa

    pf, f = _parquet_file(piece.url, storage_options)
    with f:
        if field not in pf.schema_arrow.names:
            why = f"no column {field!r} (found {pf.schema_arrow.names})"
            for r in range(pf.metadata.row_group(piece.row_group).num_rows):
                yield f"{piece.url}: row {piece.first_row + r}", None, why
            return
        column = pf.read_row_group(piece.row_group, columns=[field]).column(field)
    kind = column.type
    textual = pa.types.is_string(kind) or pa.types.is_large_string(kind)
    binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    if textual:  # Arrow does not check UTF-8 when it reads: decode the bytes ourselves
        column = column.cast(pa.large_binary())
    for r, value in enumerate(column.to_pylist()):
        where = f"{piece.url}: row {piece.first_row + r}"
        if value is None:
            yield where, None, f"column {field!r} is null"
        elif not (textual or binary):
            yield where, None, f"column {field!r} is {kind}, expected a string"
        else:
            try:
                yield where, value.decode("utf-8"), None
            except UnicodeDecodeError as exc:
                yield where, None, f"column {field!r} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
