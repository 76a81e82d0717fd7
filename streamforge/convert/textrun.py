"""Raw text to a stream: tokenize jsonl/parquet documents on local processes or Ray.

1. Read the tokenizer once (kind, sha256, vocabulary, EOS id); the token dtype is the
   narrowest that holds the vocabulary.
2. List the slices (a jsonl file, a parquet row group) and scan each one in a task
   (``textjob.scan_slice``): valid documents, bad rows, a content digest, the slice's shard
   boundaries. A bad row under ``raise`` stops here, before anything is written.
3. From the scans, every slice's first record and first shard follow by prefix sums; the
   content fingerprint and the conversion id (fingerprint plus every layout parameter) too.
4. Claim the output prefix (``claim_output``): a new prefix, or the unfinished or finished
   run of this very conversion (resume), or, with ``overwrite``, any other. A live stream
   there stays as it is: new shards take names its manifest does not list
   (``writer.next_generation``).
5. One ``textjob.write_slice`` task per slice tokenizes and writes its shards straight to the
   destination, each followed by a receipt; shards verified from an earlier run are kept.
6. The manifest goes last (atomically); then the shards it does not list (the previous
   generation, leftovers of a killed run) are removed, and the receipts with them.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any

import numpy as np

from ..errors import ConfigError, SourceError
from ..format.frames import CODECS
from ..format.manifest import TOKEN_DTYPES, Manifest
from ..format.writer import (
    build_manifest,
    choose_token_dtype,
    live_manifest,
    make_output_dir,
    next_generation,
    remove_unlisted,
    write_manifest,
)
from ..storage.open import join, open_url
from .engines import make_engine
from .text import BAD_ROW_POLICIES, list_slices
from .textjob import BYTES_PER_TOKEN, STATE_DIR, ScanTask, WriteTask, scan_slice, write_slice
from .tokenizer import load_tokenizer

JOB_NAME = "job.json"
SKIPPED_LISTED = 1000  # bad rows listed in the manifest; all of them are counted


def convert_text(
    fmt: str,
    input: str,
    output: str,
    *,
    text_field: str,
    tokenizer: str,
    tokenizer_kind: str | None = None,
    tiktoken_pattern: str | None = None,
    eos_token: str | None = None,
    eos_id: int | None = None,
    on_bad_row: str = "raise",
    engine: str = "local",
    workers: int = 1,
    ray_address: str | None = None,
    shard_size: int = 64 << 20,
    frame_size: int = 256 << 10,
    compression_level: int = 3,
    compression: str = "zstd",
    token_dtype: str | None = None,
    storage_options: dict[str, Any] | None = None,
    input_storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Manifest:
    """Tokenize the ``text_field`` of every jsonl line / parquet row into a stream."""
    _check_options(fmt, on_bad_row, compression, workers)
    start = time.perf_counter()
    in_opts = input_storage_options if input_storage_options is not None else _options_for(
        input, output, storage_options
    )
    spec = load_tokenizer(
        tokenizer, kind=tokenizer_kind, pattern=tiktoken_pattern, eos_token=eos_token,
        eos_id=eos_id, storage_options=_options_for(tokenizer, output, storage_options),
    )
    chosen = _token_dtype(spec, token_dtype)
    slices = list_slices(fmt, input, in_opts)
    url = str(output)
    fs, path = open_url(url, storage_options)
    bar = TextProgress(progress)
    runner = make_engine(engine, workers, ray_address, spec)
    try:
        bar.phase("scan", len(slices), "slice")
        scan_tasks = [
            ScanTask(s, text_field, on_bad_row, in_opts, shard_size, np.dtype(chosen).itemsize)
            for s in slices
        ]
        scans = _ordered(runner.run(scan_slice, scan_tasks), len(slices), lambda s: bar.step(1, 0))
        num_docs = sum(s.num_docs for s in scans)
        skipped = [line for s in scans for line in s.skipped]
        if num_docs == 0:
            raise SourceError(f"{input}: no documents ({len(skipped)} bad rows skipped)")
        fingerprint = _digest(["text", fmt, text_field, spec.sha256, *(s.digest for s in scans)])[:32]
        params = {
            "source_format": fmt, "text_field": text_field, "shard_size": shard_size,
            "frame_size": frame_size, "compression_level": compression_level,
            "compression": compression, "token_dtype": chosen, "on_bad_row": on_bad_row,
            "bytes_per_token_estimate": BYTES_PER_TOKEN, "eos_id": spec.eos_id,
        }
        conversion_id = _digest([fingerprint, json.dumps(params, sort_keys=True)])[:32]
        receipts, generation = claim_output(fs, path, url, conversion_id, overwrite)
        template = WriteTask(
            slices[0], scans[0], text_field, on_bad_row, in_opts, url, storage_options, chosen,
            frame_size, compression_level, compression, 0, 0, generation=generation,
        )
        bar.phase("tokenize", num_docs, "doc")
        done = _ordered(
            runner.run(write_slice, write_tasks(template, slices, scans, receipts)), len(slices),
            lambda d: bar.step(d.num_docs, d.num_tokens),
        )
    finally:
        runner.close()
        bar.close()
    conversion = {
        **params,
        "num_documents": num_docs,
        "num_slices": len(slices),
        "conversion_id": conversion_id,
        "skipped_rows": {"count": len(skipped), "listed": skipped[:SKIPPED_LISTED]},
        "eos_check": {
            "requested": "yes", "decided_by": "tokenizer", "eos_id": spec.eos_id,
            "appended_by": "tokenizer" if spec.appends_eos else "conversion",
        },
    }
    manifest = build_manifest(
        [row for d in done for row in d.rows], token_dtype=chosen, eos_id=spec.eos_id,
        vocab_size=spec.vocab_size, docs_end_with_eos=True, conversion=conversion,
        source_fingerprint=fingerprint, compression=compression, tokenizer=spec.record(),
    )
    write_manifest(fs, path, manifest)
    remove_unlisted(fs, path, manifest)
    _remove_state(fs, path)
    bar.summary(manifest, len(skipped), sum(d.kept for d in done), time.perf_counter() - start)
    return manifest


def _check_options(fmt: str, on_bad_row: str, compression: str, workers: int) -> None:
    if fmt not in ("jsonl", "parquet"):
        raise ConfigError(f"text conversion reads jsonl or parquet, not {fmt!r}")
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ConfigError(f"on_bad_row must be one of {', '.join(BAD_ROW_POLICIES)}, got {on_bad_row!r}")
    if compression not in CODECS:
        raise ConfigError(f"compression must be one of {CODECS}, got {compression!r}")
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")


def _token_dtype(spec, forced: str | None) -> str:
    """The narrowest dtype that holds the vocabulary, or ``forced`` if it does."""
    if forced is None:
        return choose_token_dtype(spec.vocab_size - 1)
    if forced not in TOKEN_DTYPES:
        raise ConfigError(f"token dtype must be one of {TOKEN_DTYPES}, got {forced!r}")
    if np.iinfo(forced).max < spec.vocab_size - 1:
        raise ConfigError(f"vocabulary of {spec.vocab_size} does not fit token dtype {forced}")
    return forced


def _ordered(results, count: int, each) -> list:
    """Results of ``count`` tasks (any order of arrival) in slice order."""
    out = [None] * count
    for result in results:
        out[result.index] = result
        each(result)
    return out


def write_tasks(template: WriteTask, slices, scans, receipts: dict[int, dict]) -> list[WriteTask]:
    """One write task per slice, with its first record and shard (prefix sums over the
    scans) and the receipts of its shards from an earlier run."""
    from dataclasses import replace

    tasks, first_record, first_shard = [], 0, 0
    for piece, scan in zip(slices, scans):
        count = len(scan.shard_starts)
        mine = {s: receipts[s] for s in range(first_shard, first_shard + count) if s in receipts}
        tasks.append(replace(
            template, piece=piece, scan=scan, first_record=first_record, first_shard=first_shard,
            receipts=mine,
        ))
        first_record, first_shard = first_record + scan.num_docs, first_shard + count
    return tasks


def _options_for(url: str, output: str, options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The storage options of ``output`` for ``url`` (the input, the tokenizer) when it lives
    on the same kind of store, or on an object store while the output is local; none for a
    local path read beside an object-store output."""
    from ..storage.open import protocol_of

    mine, theirs = protocol_of(str(url)), protocol_of(str(output))
    return options if mine == theirs or (theirs == "file" and mine != "file") else None


def _digest(parts: list[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\x00")
    return h.hexdigest()


def claim_output(
    fs, path: str, url: str, conversion_id: str, overwrite: bool
) -> tuple[dict[int, dict], int]:
    """Make the prefix ours; returns the receipts (shard -> manifest row) of earlier runs of
    this same conversion, which the tasks verify by hash before keeping, and the generation
    of the shard names to write.

    A prefix holding anything else (a manifest of another conversion, the unfinished state of
    another, or stray shards) is refused unless ``overwrite``; then the other unfinished state
    is removed. A live manifest is never removed: it stays the stream until this
    conversion's manifest replaces it, and its shards are never written over.
    """
    make_output_dir(fs, path, url)
    state = join(path, STATE_DIR)
    job_path = join(state, JOB_NAME)
    found, existing = live_manifest(fs, path, url)
    job = _read_job(fs, job_path)
    mine = job is not None and job.get("conversion_id") == conversion_id
    receipts: dict[int, dict] = {}
    other = None
    if existing is not None and existing.conversion.get("conversion_id") == conversion_id:
        receipts = {_shard_number(r.name): _row(r) for r in existing.shards}
    elif found:
        other = (
            f"a different dataset ({existing.num_shards} shards, {existing.num_records} records, "
            f"source fingerprint {existing.source_fingerprint})"
            if existing is not None else "a different dataset (an unreadable manifest)"
        )
    elif job is not None and not mine:
        other = "the unfinished conversion of a different dataset"
    elif job is None and _shard_files(fs, path):
        other = f"{len(_shard_files(fs, path))} shards and no manifest"
    if other is not None and not overwrite:
        raise ConfigError(
            f"{url} already holds {other}; write to another prefix, or pass overwrite=True / "
            "--overwrite to replace it"
        )
    if mine:  # a killed run of this conversion: its receipts name the newer shards
        receipts.update(_read_receipts(fs, state))
    else:
        _remove_state(fs, path)
        fs.makedirs(state, exist_ok=True)  # a no-op on object stores
        with fs.open(job_path, "wb") as out:
            out.write(json.dumps({"conversion_id": conversion_id}).encode())
    return receipts, next_generation(existing)


def _read_job(fs, job_path: str) -> dict | None:
    """The ``job.json`` of an unfinished conversion, or None (a torn one counts as another's)."""
    try:
        job = json.loads(fs.cat_file(job_path))
    except FileNotFoundError:
        return None
    except ValueError:
        return {}
    return job if isinstance(job, dict) else {}


def _row(info) -> dict[str, Any]:
    keys = ("name", "bytes", "sha256", "num_records", "num_tokens", "num_frames", "index_offset", "index_bytes")
    row = {k: getattr(info, k) for k in keys}
    if info.num_docs is not None:
        row["num_docs"] = info.num_docs
    return row


def _shard_number(name: str) -> int:
    return int(name.split("-")[1].split(".")[0])


def _shard_files(fs, path: str) -> list[str]:
    try:
        return [p for p in fs.ls(path, detail=False) if p.rstrip("/").rsplit("/", 1)[-1].startswith("shard-")]
    except FileNotFoundError:
        return []


def _read_receipts(fs, state: str) -> dict[int, dict]:
    receipts = {}
    for item in fs.ls(state, detail=False):
        name = item.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("shard-") and name.endswith(".json"):
            try:
                row = json.loads(fs.cat_file(item))
                receipts[_shard_number(row["name"])] = row
            except (ValueError, KeyError, FileNotFoundError):
                continue  # a torn receipt: that shard is redone
    return receipts


def _remove_state(fs, path: str) -> None:
    state = join(path, STATE_DIR)
    try:
        if fs.exists(state):
            fs.rm(state, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(path)


class TextProgress:
    """A tqdm bar per phase (slices scanned, then documents tokenized, with docs/s and
    tokens/s), and a one-line summary on stderr at the end."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None

    def phase(self, name: str, total: int, unit: str) -> None:
        self.close()
        self.docs = self.tokens = 0
        self.start = time.perf_counter()
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=unit, desc=name, dynamic_ncols=True)

    def step(self, n: int, tokens: int) -> None:
        self.docs += n
        self.tokens += tokens
        if self.bar is not None:
            if tokens:
                elapsed = max(time.perf_counter() - self.start, 1e-9)
                self.bar.set_postfix_str(
                    f"{self.docs / elapsed:,.0f} docs/s, {self.tokens / elapsed:,.0f} tok/s", refresh=False
                )
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def summary(self, manifest: Manifest, skipped: int, kept: int, seconds: float) -> None:
        if not self.enabled:
            return
        resumed = f", {kept} shards kept from an earlier run" if kept else ""
        print(
            f"converted {manifest.num_records:,} documents, {manifest.num_tokens:,} tokens, "
            f"{manifest.num_shards} shards, {manifest.num_bytes:,} bytes, {skipped:,} rows skipped "
            f"in {seconds:.1f} s ({manifest.num_tokens / max(seconds, 1e-9):,.0f} tok/s){resumed}",
            file=sys.stderr,
        )
