"""Resolve any fsspec URL (local path, file://, s3://, gs://...) to a filesystem and a path."""

from __future__ import annotations

from typing import Any

import fsspec


def open_url(url: str, storage_options: dict[str, Any] | None = None):
    """``(filesystem, path)`` for ``url``; ``storage_options`` go to the filesystem."""
    fs, path = fsspec.core.url_to_fs(str(url), **(storage_options or {}))
    return fs, path


def join(path: str, name: str) -> str:
    return f"{path.rstrip('/')}/{name}"
