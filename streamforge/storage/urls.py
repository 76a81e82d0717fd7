"""Plain URL helpers shared by the storage backends (no I/O, no imports of theirs)."""

from __future__ import annotations


def without_scheme(url: str, *schemes: str) -> str:
    """``url`` less the first of ``schemes`` (``"s3"``: ``s3://``) it starts with."""
    url = str(url)
    for scheme in schemes:
        if url.startswith(scheme + "://"):
            return url[len(scheme) + 3:]
    return url


def join(path: str, name: str) -> str:
    return f"{path.rstrip('/')}/{name}"
