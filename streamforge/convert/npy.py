"""Numpy token arrays: a 1-D ``.npy`` (or a headerless memmap with ``--dtype``).

Documents come from an EOS id (each keeps its EOS, as in the flat format) or from an offsets
array: document i is ``tokens[offsets[i]:offsets[i+1]]``, with ``offsets[0] == 0`` and
``offsets[-1] == len(tokens)`` so that no token is silently dropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError, SourceError
from .base import (
    NPY_MAGIC,
    ArraySource,
    MappedTokens,
    eos_bounds,
    file_size,
    raw_tokens,
    split_source,
    token_dtype_of,
)


def map_npy(path: str, dtype: Any = None) -> MappedTokens:
    """Map the token array of ``path``: a .npy file, or raw tokens of ``dtype``."""
    size = file_size(path, "token array")
    with open(path, "rb") as f:
        magic = f.read(len(NPY_MAGIC))
    if magic != NPY_MAGIC:
        if dtype is None:
            raise SourceError(
                f"{path}: not a .npy file (no numpy magic); pass --dtype to read it as raw tokens"
            )
        return raw_tokens(path, dtype, "token array")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        raise SourceError(f"{path}: unreadable .npy ({exc}); truncated?") from exc
    if array.ndim != 1:
        raise SourceError(f"{path}: token array must be 1-D, found shape {array.shape}")
    found = token_dtype_of(array.dtype, path)
    if dtype is not None and token_dtype_of(dtype, path) != found:
        raise SourceError(f"{path}: .npy holds {found}, but --dtype {np.dtype(dtype)} was given")
    if not isinstance(array, np.memmap):  # zero-size arrays are loaded, not mapped
        return MappedTokens(path=path, dtype=found, offset=0, count=0)
    expected = array.offset + array.nbytes
    if size < expected:  # pragma: no cover - np.load already refuses most truncations
        raise SourceError(f"{path}: {size} bytes, the .npy header needs {expected}")
    return MappedTokens(path=path, dtype=found, offset=array.offset, count=len(array))


def load_offsets(path: str, num_tokens: int, where: str) -> np.ndarray:
    """A validated document offsets array (int64, 0 ... num_tokens, non-decreasing)."""
    try:
        offsets = np.load(path, allow_pickle=False)
    except FileNotFoundError as exc:
        raise SourceError(f"{path}: offsets file not found") from exc
    except ValueError as exc:
        raise SourceError(f"{path}: unreadable offsets .npy ({exc})") from exc
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) < 2:
        raise SourceError(
            f"{path}: offsets must be a 1-D integer array of at least 2 entries, found "
            f"{offsets.dtype} with shape {offsets.shape}"
        )
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != num_tokens:
        raise SourceError(
            f"{path}: offsets run {int(offsets[0])}..{int(offsets[-1])}, but {where} holds "
            f"{num_tokens} tokens (they must run 0..{num_tokens})"
        )
    steps = np.diff(offsets)
    if int(steps.min()) < 0:
        bad = int(np.argmin(steps))
        raise SourceError(
            f"{path}: offsets decrease at document {bad} ({int(offsets[bad])} -> "
            f"{int(offsets[bad + 1])})"
        )
    return offsets


def open_npy(
    path: str, *, dtype: Any = None, eos_id: int | None = None, offsets: str | None = None
) -> ArraySource:
    """The documents of the token array at ``path``, split by ``offsets`` or ``eos_id``."""
    path = str(path)
    tokens = map_npy(path, dtype)
    if tokens.count == 0:
        raise SourceError(f"{path}: the array holds no tokens")
    if offsets is not None:
        bounds = load_offsets(str(offsets), tokens.count, path)
        params: dict[str, Any] = {"split": "offsets"}
        ends_with_eos = False
    elif eos_id is not None:
        bounds = eos_bounds(tokens.array, int(eos_id), path)
        params = {"split": "eos", "eos_id": int(eos_id)}
        ends_with_eos = True
    else:
        raise ConfigError(f"{path}: the npy format needs --eos-id or --offsets to split documents")
    return split_source(
        where=path,
        tokens=tokens,
        bounds=bounds,
        eos_id=None if eos_id is None else int(eos_id),
        docs_end_with_eos=ends_with_eos,
        params=params,
        format_name="npy",
    )
