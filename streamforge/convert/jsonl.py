"""Row formats: one pre-tokenized document per JSON line or per Parquet row.

The token lists of the named field (default ``input_ids``) are gathered into one flat int64
array in memory, in file order then row order; ``--input`` may name a file, a directory
(its ``*.jsonl``/``*.json``/``*.jsonl.gz``/``*.jsonl.zst`` or ``*.parquet`` files, sorted)
or a glob. JSON files are opened through fsspec with compression inferred from the suffix.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np

from ..errors import ConfigError, SourceError
from .base import ArraySource

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz")
PARQUET_SUFFIXES = (".parquet",)


def list_inputs(path: str, suffixes: tuple[str, ...], what: str) -> list[str]:
    """The files named by ``path`` (a file, a directory or a glob), sorted."""
    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, name) for name in os.listdir(path) if name.endswith(suffixes)
        )
    elif any(ch in path for ch in "*?["):
        files = sorted(glob.glob(path))
    else:
        if not os.path.exists(path):
            raise SourceError(f"{path}: {what} input not found")
        files = [path]
    if not files:
        raise SourceError(f"{path}: no {what} files ({', '.join(suffixes)}) found")
    return files


def row_tokens(value: Any, field: str, where: str) -> np.ndarray:
    """One row's token list as int64, or a SourceError naming the row."""
    if not isinstance(value, list):
        raise SourceError(f"{where}: field {field!r} is {type(value).__name__}, expected a list of ints")
    if not value:
        return np.zeros(0, np.int64)
    if not all(type(v) is int for v in value):
        bad = next(v for v in value if type(v) is not int)
        raise SourceError(f"{where}: field {field!r} holds {bad!r}, expected token ids (ints)")
    try:
        return np.asarray(value, dtype=np.int64)
    except OverflowError as exc:
        raise SourceError(f"{where}: field {field!r} holds a token id beyond int64") from exc


def read_jsonl(path: str, field: str) -> list[np.ndarray]:
    import fsspec

    rows: list[np.ndarray] = []
    with fsspec.open(path, "rt", compression="infer", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise SourceError(f"{where}: not valid JSON ({exc})") from exc
            if not isinstance(obj, dict) or field not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise SourceError(f"{where}: no field {field!r} (found {keys})")
            rows.append(row_tokens(obj[field], field, where))
    return rows


def read_parquet(path: str, field: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat tokens, lengths) of the list column ``field`` of one Parquet file."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError("the parquet format needs pyarrow (pip install 'streamforge[parquet]')") from exc
    try:
        table = pq.read_table(path, columns=[field])
    except (pa.ArrowInvalid, OSError) as exc:
        raise SourceError(f"{path}: cannot read column {field!r} ({exc})") from exc
    except KeyError as exc:  # pragma: no cover - pyarrow raises ArrowInvalid in practice
        raise SourceError(f"{path}: no column {field!r}") from exc
    column = table.column(field)
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(
        kind.value_type
    ):
        raise SourceError(f"{path}: column {field!r} is {kind}, expected a list of integers")
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if array.null_count:
        row = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        raise SourceError(f"{path}: row {row}: column {field!r} is null")
    values = pc.list_flatten(array)
    if values.null_count:
        raise SourceError(f"{path}: column {field!r} holds null token ids")
    lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)
    tokens = values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return tokens, lengths


def _in_memory(where: str, tokens: np.ndarray, lengths: np.ndarray, fmt: str, params) -> ArraySource:
    bounds = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=bounds[1:])
    source = ArraySource(
        where=where,
        tokens=tokens,
        seq_starts=bounds[:-1],
        seq_lengths=lengths,
        params=params,
    )
    source.format = fmt
    return source


def open_jsonl(path: str, *, field: str = "input_ids", eos_id: int | None = None) -> ArraySource:
    files = list_inputs(str(path), JSONL_SUFFIXES, "jsonl")
    rows = [row for f in files for row in read_jsonl(f, field)]
    if not rows:
        raise SourceError(f"{path}: no documents (every jsonl file is empty)")
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    tokens = np.concatenate(rows)
    source = _in_memory(str(path), tokens, lengths, "jsonl", {"split": "rows", "field": field})
    source.eos_id = eos_id
    return source


def open_parquet(path: str, *, field: str = "input_ids", eos_id: int | None = None) -> ArraySource:
    files = list_inputs(str(path), PARQUET_SUFFIXES, "parquet")
    parts = [read_parquet(f, field) for f in files]
    tokens = np.concatenate([t for t, _ in parts])
    lengths = np.concatenate([n for _, n in parts])
    if not len(lengths):
        raise SourceError(f"{path}: no documents (every parquet file has zero rows)")
    source = _in_memory(str(path), tokens, lengths, "parquet", {"split": "rows", "field": field})
    source.eos_id = eos_id
    return source
