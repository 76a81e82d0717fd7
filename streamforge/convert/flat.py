"""Flat token files (nanoGPT ``train.bin``): raw tokens of one dtype, documents split by EOS.

Document i runs up to and including the i-th EOS token; tokens after the last EOS form a
final document. Finding the boundaries is one vectorized scan of the memory-mapped file.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, SourceError
from .base import ArraySource, eos_bounds, raw_tokens, split_source

DEFAULT_DTYPE = "uint16"


def open_flat(path: str, *, dtype: Any = None, eos_id: int | None = None) -> ArraySource:
    """The EOS-separated documents of the raw token file at ``path``."""
    path = str(path)
    if eos_id is None:
        raise ConfigError(f"{path}: the flat format needs --eos-id to split documents")
    tokens = raw_tokens(path, dtype or DEFAULT_DTYPE, "flat token file")
    if tokens.count == 0:
        raise SourceError(f"{path}: the file holds no tokens")
    bounds = eos_bounds(tokens.array, int(eos_id), path)
    return split_source(
        where=path,
        tokens=tokens,
        bounds=bounds,
        eos_id=int(eos_id),
        docs_end_with_eos=True,
        params={"split": "eos", "eos_id": int(eos_id)},
        format_name="flat",
    )
