"""Publishing a stream: its manifest, written after every shard and replaced last.

Replacing a stream never touches a file its live manifest lists: the new shards take the next
*generation* of names (``shard-NNNNNN.gG.tar.zst``, ``manifest.shard_name``), ``index.json``
is replaced last (one PUT on an object store, a rename on a local disk), and only then are
the files the new manifest does not list removed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from ..storage.open import join
from .manifest import MANIFEST_NAME, Manifest, shard_generation


def build_manifest(
    rows: list[dict[str, Any]],
    *,
    token_dtype: str,
    eos_id: int | None,
    vocab_size: int | None,
    docs_end_with_eos: bool,
    conversion: dict[str, Any] | None = None,
    source_fingerprint: str | None = None,
    compression: str = "zstd",
    tokenizer: dict[str, Any] | None = None,
) -> Manifest:
    columns = {
        k: np.asarray([r[k] for r in rows], dtype=np.int64)
        for k in ("bytes", "num_records", "num_tokens", "num_frames", "index_offset", "index_bytes")
    }
    if rows and all("num_docs" in r for r in rows):
        columns["num_docs"] = np.asarray([r["num_docs"] for r in rows], dtype=np.int64)
    return Manifest(
        token_dtype=token_dtype,
        shard_names=[r["name"] for r in rows],
        shard_sha256=[r["sha256"] for r in rows],
        columns=columns,
        eos_id=eos_id,
        vocab_size=vocab_size,
        docs_end_with_eos=docs_end_with_eos,
        conversion=conversion or {},
        source_fingerprint=source_fingerprint,
        compression=compression,
        tokenizer=tokenizer,
    )


def write_manifest(fs, path: str, manifest: Manifest) -> None:
    """Write ``index.json`` last, atomically; the dataset exists from this moment on.

    An object store makes one PUT visible whole or not at all; on a local disk the manifest
    is written beside its name and renamed over it, so a crash never leaves half a manifest.
    """
    target = join(path, MANIFEST_NAME)
    if "file" not in _protocols(fs):
        with fs.open(target, "wb") as out:
            out.write(manifest.dumps())
        return
    import os

    tmp = f"{target}.tmp-{os.getpid()}"
    with fs.open(tmp, "wb") as out:
        out.write(manifest.dumps())
    os.replace(tmp, target)


def _protocols(fs) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def remove_unlisted(fs, path: str, manifest: Manifest) -> list[str]:
    """Remove the shard files under ``path`` that ``manifest`` does not list (after it is in
    place: the previous generation, leftovers of a killed or larger conversion); returns
    their names."""
    listed = set(manifest.shard_names)
    fs.invalidate_cache(path)
    stale = []
    for item in fs.ls(path, detail=False):
        name = item.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("shard-") and name not in listed:
            stale.append(name)
            fs.rm(item)
    return stale


def next_generation(live: Manifest | None) -> int:
    """The generation of shard names a conversion writes beside the ``live`` manifest: one past
    every name it lists, so no live shard is ever written over (0 for a new prefix)."""
    if live is None:
        return 0
    return 1 + max((shard_generation(n) for n in live.shard_names), default=0)


def make_output_dir(fs, path: str, url: str) -> None:
    """Create the output directory (a no-op on object stores), or a ``ConfigError`` naming
    ``url`` when a local path is, or lies under, a regular file."""
    if "file" in _protocols(fs) and fs.isfile(path):
        raise ConfigError(f"{url}: the output path is a regular file; a stream is a directory, "
                          "give a directory path (new or holding a stream)")
    try:
        fs.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ConfigError(f"{url}: cannot create the output directory: {exc}") from exc


def live_manifest(fs, path: str, url: str) -> tuple[bool, Manifest | None]:
    """(whether ``index.json`` exists, the manifest or None where it does not parse)."""
    target = join(path, MANIFEST_NAME)
    if not fs.exists(target):
        return False, None
    try:
        return True, Manifest.loads(fs.cat_file(target), url)
    except Exception:  # noqa: BLE001 - any unreadable manifest is "a different dataset"
        return True, None


def prepare_output(
    fs, path: str, url: str, *, source_fingerprint: str | None, overwrite: bool,
    layout: dict[str, Any] | None = None,
) -> int:
    """Refuse an output prefix that already holds a different dataset; returns the generation
    of shard names to write (``next_generation``).

    The same source converted with the same parameters (``layout``: the ``conversion``
    entries that decide the shard files, such as the shard size) may be written again, and
    with ``overwrite`` any other dataset may be replaced. Either way the live stream stays
    as it is until the new manifest replaces it.
    """
    found, existing = live_manifest(fs, path, url)
    if not found:
        return 0
    same = (
        existing is not None
        and source_fingerprint is not None
        and existing.source_fingerprint == source_fingerprint
        and all(existing.conversion.get(k) == v for k, v in (layout or {}).items())
    )
    if same:
        return next_generation(existing)
    if not overwrite:
        what = (
            f"{existing.num_shards} shards, {existing.num_records} records, source "
            f"fingerprint {existing.source_fingerprint}"
            if existing is not None
            else "an unreadable manifest"
        )
        raise ConfigError(
            f"{url} already holds a different dataset ({what}); write to another prefix, or "
            "pass overwrite=True / --overwrite to replace it"
        )
    return next_generation(existing)
