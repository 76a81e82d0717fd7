"""Parallel, deterministic conversion of a source corpus into a stream.

1. Open and validate the source: document lengths from its index/offsets, whether the
   documents already end with EOS (one gathered token per document, ``eos.decide``), one
   vectorized min/max pass over the tokens (negative ids, ids over the vocabulary, the token
   dtype), the content fingerprint. Nothing is written until all of this passed.
2. Every record's archive size follows from its length (``tar.records_nbytes``), so
   ``writer.cut_points`` places every shard boundary up front.
3. Contiguous runs of shards go to N worker processes; each reads its documents with one
   slice, encodes them (``writer.encode_shard_flat``) and writes straight to the output URL,
   under shard names the live manifest (if any) does not list (``writer.next_generation``).
   Workers die with the coordinator (``lifeline``).
4. The coordinator collects the manifest rows in shard order and writes ``index.json`` last,
   then removes the shards it does not list (the previous generation).

Shard bytes depend only on (documents, token dtype, shard size, frame size, level), never on
the number of workers, so every N gives the same files.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError, SourceError
from ..format.frames import CODECS
from ..format.manifest import TOKEN_DTYPES, Manifest
from ..format.tar import records_nbytes
from ..format.writer import (
    DEFAULT_FRAME_SIZE,
    build_manifest,
    choose_token_dtype,
    cut_points,
    encode_shard_flat,
    make_output_dir,
    parse_size,
    prepare_output,
    remove_unlisted,
    write_manifest,
    write_shard,
)
from ..storage.open import open_url
from .base import ArraySource
from .eos import decide
from .flat import open_flat
from .jsonl import open_jsonl, open_parquet
from .lifeline import die_with_parent, pool_context
from .megatron import open_megatron
from .npy import open_npy

FORMATS = ("megatron", "flat", "npy", "jsonl", "parquet")
JOBS_PER_WORKER = 4  # contiguous shard runs per worker: balances uneven shards


def open_source(
    fmt: str,
    path: str,
    *,
    eos_id: int | None = None,
    dtype: Any = None,
    field: str = "input_ids",
    offsets: str | None = None,
) -> ArraySource:
    """The validated source of format ``fmt`` at ``path``."""
    if fmt == "megatron":
        return open_megatron(path, dtype=dtype, eos_id=eos_id)
    if fmt == "flat":
        return open_flat(path, dtype=dtype, eos_id=eos_id)
    if fmt == "npy":
        return open_npy(path, dtype=dtype, eos_id=eos_id, offsets=offsets)
    if fmt == "jsonl":
        return open_jsonl(path, field=field, eos_id=eos_id)
    if fmt == "parquet":
        return open_parquet(path, field=field, eos_id=eos_id)
    raise ConfigError(f"unknown source format {fmt!r}; choose one of {', '.join(FORMATS)}")


def progress_enabled() -> bool:
    """The one place the environment is read: ``STREAMFORGE_NO_PROGRESS=1`` hides bars."""
    return os.environ.get("STREAMFORGE_NO_PROGRESS", "") not in ("1", "true", "yes")


@dataclass(frozen=True)
class ShardJob:
    """A contiguous run of shards for one worker; picklable."""

    source: ArraySource
    shards: list[tuple[int, int, int]]  # (shard, first document, stop document)
    url: str
    storage_options: dict[str, Any] | None
    token_dtype: str
    frame_size: int
    compression_level: int
    compression: str = "zstd"
    generation: int = 0  # of the shard names written (``writer.next_generation``)


def run_job(job: ShardJob) -> list[tuple[int, dict[str, Any], int, int]]:
    """Encode and write the shards of ``job``; (shard, row, documents, tokens) for each.

    Shard k is hashed and written on a helper thread while shard k+1 is encoded (zstd,
    sha256 and file writes all release the GIL); at most one shard waits to be written.
    """
    fs, path = open_url(job.url, job.storage_options)
    dtype = np.dtype(job.token_dtype).newbyteorder("<")
    done = []

    def write(shard, encoded, documents, tokens):
        try:
            row = write_shard(fs, path, shard, encoded, job.compression, job.generation)
        except OSError as exc:
            exc.add_note(f"while writing shard {shard} of {job.url}")
            raise
        return shard, row, documents, tokens

    with ThreadPoolExecutor(max_workers=1) as writer:
        pending = None
        for shard, lo, hi in job.shards:
            tokens, offsets = job.source.read(lo, hi)
            encoded = encode_shard_flat(
                np.asarray(tokens).astype(dtype, copy=False),
                offsets,
                lo,
                frame_size=job.frame_size,
                compression_level=job.compression_level,
                compression=job.compression,
            )
            if pending is not None:
                done.append(pending.result())
            pending = writer.submit(write, shard, encoded, hi - lo, int(offsets[-1]))
        if pending is not None:
            done.append(pending.result())
    return done


def check_tokens(
    source: ArraySource,
    num_docs: int,
    vocab_size: int | None,
    forced: str | None,
    appended: int | None = None,
) -> str:
    """Validate the token ids of the first ``num_docs`` documents; returns the token dtype.

    ``appended``: a token id the conversion adds (EOS), which the dtype must hold as well.
    """
    low, high = source.token_range(num_docs)
    if low < 0:
        raise SourceError(f"{source.where}: negative token id {low}")
    if vocab_size is not None and high >= vocab_size:
        raise SourceError(f"{source.where}: token id {high} is not below vocab size {vocab_size}")
    if source.eos_id is not None and vocab_size is not None and source.eos_id >= vocab_size:
        raise ConfigError(f"eos id {source.eos_id} is not below vocab size {vocab_size}")
    if appended is not None:
        high = max(high, appended)
    chosen = choose_token_dtype(high, vocab_size)
    if forced is None:
        return chosen
    if forced not in TOKEN_DTYPES:
        raise ConfigError(f"token dtype must be one of {TOKEN_DTYPES}, got {forced!r}")
    if np.iinfo(forced).max < max(high, (vocab_size or 1) - 1):
        raise ConfigError(
            f"{source.where}: token id {max(high, (vocab_size or 1) - 1)} does not fit the "
            f"requested token dtype {forced}"
        )
    return forced


def plan_jobs(doc_starts: list[int], num_docs: int, workers: int) -> list[list[tuple[int, int, int]]]:
    """Shards as (shard, lo, hi), grouped into contiguous runs, a few per worker."""
    bounds = doc_starts + [num_docs]
    shards = [(s, bounds[s], bounds[s + 1]) for s in range(len(doc_starts))]
    per_job = max(1, -(-len(shards) // (workers * JOBS_PER_WORKER))) if workers > 1 else 1
    return [shards[i : i + per_job] for i in range(0, len(shards), per_job)]


def convert(
    fmt: str,
    input: str,
    output: str,
    *,
    shard_size: int | str = "64MiB",
    workers: int = 1,
    eos_id: int | None = None,
    dtype: Any = None,
    token_dtype: str | None = None,
    field: str = "input_ids",
    limit: int | None = None,
    vocab_size: int | None = None,
    offsets: str | None = None,
    docs_end_with_eos: str | bool = "auto",
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    frame_size: int | str = DEFAULT_FRAME_SIZE,
    compression_level: int = 3,
    compression: str = "zstd",
    progress: bool | None = None,
    text_field: str | None = None,
    tokenizer: str | None = None,
    tokenizer_kind: str | None = None,
    tiktoken_pattern: str | None = None,
    eos_token: str | None = None,
    on_bad_row: str = "raise",
    engine: str = "local",
    ray_address: str | None = None,
    input_storage_options: dict[str, Any] | None = None,
) -> Manifest:
    """Convert the ``fmt`` corpus at ``input`` into a stream at ``output``; returns its manifest.

    Record k of the stream is document k of the source (zero-length documents included).

    ``docs_end_with_eos`` (``"auto"``, ``"yes"``, ``"no"``, or a bool): whether the manifest
    says documents end with ``eos_id``, so that the pipeline appends none. ``"auto"`` checks
    the document ends: yes if every non-empty document ends with ``eos_id``, no if none does
    (or no ``eos_id`` is given), and a ``SourceError`` for a mix. ``"yes"`` appends EOS at
    conversion to the documents that lack it; ``"no"`` leaves the appending to the pipeline.
    See ``streamforge.convert.eos`` and docs/convert.md.

    Raw text: with ``text_field`` (jsonl/parquet) and ``tokenizer`` (a ``tokenizer.json``, a
    tiktoken BPE file with ``tiktoken_pattern``, or a sentencepiece ``.model``), each
    document is tokenized on ``engine`` (``"local"``: ``workers`` processes; ``"ray"``: a Ray
    cluster at ``ray_address``/``RAY_ADDRESS``, or a local one), with EOS appended; bad rows
    follow ``on_bad_row`` (``"raise"`` or ``"skip"``). See ``streamforge.convert.textrun``.
    """
    if text_field is not None or tokenizer is not None:
        return _convert_text(
            fmt, input, output, text_field=text_field, tokenizer=tokenizer,
            tokenizer_kind=tokenizer_kind, tiktoken_pattern=tiktoken_pattern, eos_token=eos_token,
            eos_id=eos_id, on_bad_row=on_bad_row, engine=engine, workers=workers,
            ray_address=ray_address, shard_size=parse_size(shard_size),
            frame_size=parse_size(frame_size), compression_level=compression_level,
            compression=compression, token_dtype=token_dtype, storage_options=storage_options,
            input_storage_options=input_storage_options, overwrite=overwrite,
            progress=progress_enabled() if progress is None else progress,
            unused={"dtype": dtype, "limit": limit, "vocab_size": vocab_size, "offsets": offsets},
        )
    if engine != "local":
        raise ConfigError(f"engine {engine!r} runs text conversions only (--text-field); token "
                          "corpora convert on local processes (--workers)")
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    if compression not in CODECS:
        raise ConfigError(f"compression must be one of {CODECS}, got {compression!r}")
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be a positive number of documents, got {limit}")
    if vocab_size is not None and vocab_size < 1:
        raise ConfigError(f"vocab size must be positive, got {vocab_size}")
    if eos_id is not None and int(eos_id) < 0:
        raise ConfigError(f"eos id must be a non-negative token id, got {eos_id}")
    shard_bytes, frame_bytes = parse_size(shard_size), parse_size(frame_size)
    source = open_source(fmt, input, eos_id=eos_id, dtype=dtype, field=field, offsets=offsets)
    lengths = source.lengths()
    if limit is not None:
        lengths = lengths[:limit]
    num_docs = len(lengths)
    if num_docs == 0:
        raise SourceError(f"{source.where}: the corpus holds no documents")
    if int(lengths.sum()) == 0:
        raise SourceError(f"{source.where}: the corpus holds {num_docs} documents but no tokens")
    eos = decide(source, num_docs, docs_end_with_eos)
    if eos.append is not None:
        source.append_eos = eos.append
        lengths = source.lengths()[:num_docs]
    appended = source.eos_id if eos.append is not None else None
    chosen = check_tokens(source, num_docs, vocab_size, token_dtype, appended)
    fingerprint = source.fingerprint() if limit is None else f"{source.fingerprint()}:{num_docs}"
    if eos.append is not None:  # the records differ from the source documents
        fingerprint += f":eos+{eos.record['eos_appended']}"
    itemsize = np.dtype(chosen).itemsize
    doc_starts = cut_points(records_nbytes(lengths, itemsize), shard_bytes)

    url = str(output)
    fs, path = open_url(url, storage_options)
    layout = {"shard_size": shard_bytes, "frame_size": frame_bytes, "compression": compression,
              "compression_level": compression_level}
    make_output_dir(fs, path, url)
    generation = prepare_output(
        fs, path, url, source_fingerprint=fingerprint, overwrite=overwrite, layout=layout
    )
    jobs = [
        ShardJob(
            source=source.view(run[0][1], run[-1][2]),
            shards=run,
            url=url,
            storage_options=storage_options,
            token_dtype=chosen,
            frame_size=frame_bytes,
            compression_level=compression_level,
            compression=compression,
            generation=generation,
        )
        for run in plan_jobs(doc_starts, num_docs, workers)
    ]
    total_bytes = int(lengths.sum()) * source.dtype.itemsize
    show = progress_enabled() if progress is None else progress
    bar = Progress(total_bytes, source.dtype.itemsize, show)
    try:
        rows = run_jobs(jobs, workers, bar.update)
    finally:
        bar.close()

    conversion = {
        "source_format": fmt,
        "source_dtype": source.dtype.name,
        "num_documents": num_docs,
        "shard_size": shard_bytes,
        "frame_size": frame_bytes,
        "compression_level": compression_level,
        "compression": compression,
        "limit": limit,
        **source.params,
        "eos_check": eos.record,
    }
    manifest = build_manifest(
        rows,
        token_dtype=chosen,
        eos_id=source.eos_id,
        vocab_size=vocab_size,
        docs_end_with_eos=eos.docs_end_with_eos,
        conversion=conversion,
        source_fingerprint=fingerprint,
        compression=compression,
    )
    write_manifest(fs, path, manifest)
    remove_unlisted(fs, path, manifest)
    return manifest


def _convert_text(fmt, input, output, *, text_field, tokenizer, unused, **options) -> Manifest:
    from .textrun import convert_text

    if not text_field or not tokenizer:
        raise ConfigError("a text conversion needs both text_field (--text-field) and tokenizer (--tokenizer)")
    given = sorted(k for k, v in unused.items() if v is not None)
    if given:
        raise ConfigError(f"{', '.join(given)} apply to token-id sources, not to a text conversion")
    return convert_text(fmt, input, output, text_field=text_field, tokenizer=tokenizer, **options)


def run_jobs(jobs: list[ShardJob], workers: int, update: Callable[[int, int], None]) -> list[dict]:
    """Run ``jobs`` inline (one worker) or in a process pool; rows in shard order."""
    rows: dict[int, dict[str, Any]] = {}

    def collect(done) -> None:
        for shard, row, docs, tokens in done:
            rows[shard] = row
            update(docs, tokens)

    if workers == 1 or len(jobs) == 1:
        for job in jobs:
            collect(run_job(job))
    else:
        with ProcessPoolExecutor(
            max_workers=workers, mp_context=pool_context(), initializer=die_with_parent,
            initargs=(os.getpid(),),
        ) as pool:
            futures = [pool.submit(run_job, job) for job in jobs]
            for future in as_completed(futures):
                collect(future.result())
    return [rows[s] for s in sorted(rows)]


class Progress:
    """A tqdm bar over source token bytes, with documents/s and tokens/s alongside."""

    def __init__(self, total_bytes: int, itemsize: int, enabled: bool) -> None:
        self.itemsize = itemsize
        self.docs = 0
        self.tokens = 0
        self.start = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_bytes, unit="B", unit_scale=True, desc="convert", dynamic_ncols=True
            )

    def update(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        if self.bar is None:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"{self.docs / elapsed:,.0f} docs/s, {self.tokens / elapsed:,.0f} tok/s", refresh=False
        )
        self.bar.update(tokens * self.itemsize)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
