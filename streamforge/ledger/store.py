"""The data-order ledger: which document pieces every rank delivered at every step.

``StreamingLoader(ledger_dir=URL)`` keeps one ``LedgerWriter`` per rank. Each batch handed
out (or dropped by ``skip_steps``) adds one step: its pass and, per document piece, the
stream, shard, record, token range and flat position. Pieces are kept as the ``RowBatch``
columns themselves (references to seven small arrays per step, no loop over pieces) and
written every ``chunk_steps`` steps, and whenever the loader's ``state_dict()`` is taken, as
one new object: object stores cannot append, so a rank's ledger is a series of chunks. The
training thread encodes a chunk; a background thread puts it (with streamforge's retries);
``state_dict()`` returns once every chunk so far is on storage. A step costs about 40
bytes per piece on storage (an 8x2048 batch of ~600-token documents has ~17 pieces: ~0.7 KB)
and a few microseconds of the training thread (docs/benchmarks.md, section ledger).

Layout under the ledger URL::

    generations/gen-000002/rank00003.json   rank 3's header of generation 2 (written before
                                            its first chunk)
    rank00003/gen-000002-000000.npz         its chunks, numbered from 0
    rank00003/gen-000002-000001.npz

A new generation lists ``generations/`` only (one folder per generation), never the chunks.

Generations. A fresh start and every ``load_state_dict`` begin a generation, numbered one
past the largest number in ``generations/`` (where every rank of every restart writes),
agreed by an all-reduce MAX when a process group exists, so all ranks of one restart share
one number whatever the world size. The header keeps the step the generation resumed at. A restart from
step ``s`` means the training rolled back to ``s``: every record of an earlier restart with
step ``>= s`` is void, on every rank, whether or not it reached storage before the job was
killed (``read_ledger`` applies this). A checkpoint always has its steps on storage because
``state_dict()`` flushes first.

Without a process group, a rank that starts late can see the first chunk of a faster rank of
the same restart and take the next number. ``group_restarts`` folds such generations back
together: adjacent generations that resumed at the same step on disjoint sets of ranks are
one restart. Two real restarts from the same checkpoint always share rank 0, so they stay
apart.

Writes are atomic: a local chunk is written under a temporary name and renamed; an object
store put is atomic. Readers ignore anything that is not a finished chunk or header.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import socket
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from ..pipeline.batch import RowBatch
from ..errors import LedgerError
from ..storage.config import RetryPolicy
from ..storage.open import join, open_url
from ..storage.retry import Retrier
from ..topology import Topology
from .layout import (
    DEFAULT_CHUNK_STEPS, FORMAT, GENERATIONS, PIECE_COLUMNS, PIECE_DTYPE, STEP_COLUMNS, STEP_DTYPE, VERSION,
    last_generation, piece_columns, rank_dir,
)
from .read import Ledger, group_restarts, read_ledger, rollback_cutoffs

__all__ = [  # with the reader (read.py) and the layout (layout.py), re-exported
    "DEFAULT_CHUNK_STEPS", "FORMAT", "GENERATIONS", "PIECE_COLUMNS", "PIECE_DTYPE", "STEP_COLUMNS", "STEP_DTYPE",
    "VERSION", "Ledger", "LedgerWriter", "group_restarts", "rank_dir", "read_ledger", "rollback_cutoffs",
]


class LedgerWriter:
    """Appends one rank's steps to the ledger at ``url`` (any fsspec URL), in chunks.

    ``meta`` (plain data: streams, seq_len, batch size, world size...) goes into every
    generation header. ``damaged()`` (optional) returns the records skipped as damaged so far;
    ``describe_pass(pass_idx)`` (optional) the plan summary of a pass (``plan_summary``). Both
    are called at most once per chunk / per pass.
    """

    def __init__(
        self, url: str, *, rank: int, world_size: int, storage_options: dict[str, Any] | None = None,
        meta: dict[str, Any], chunk_steps: int = DEFAULT_CHUNK_STEPS,
        damaged: Callable[[], list] | None = None, describe_pass: Callable[[int], dict] | None = None,
    ) -> None:
        if chunk_steps < 1:
            raise LedgerError(f"chunk_steps must be >= 1, got {chunk_steps}")
        if not 0 <= rank < world_size:
            raise LedgerError(f"rank {rank} is outside world_size {world_size}")
        self.url = str(url)
        self.rank, self.world_size = int(rank), int(world_size)
        self.meta = json.loads(json.dumps(meta))  # plain data, copied
        self.chunk_steps = int(chunk_steps)
        self._damaged = damaged
        self._describe_pass = describe_pass
        policy = RetryPolicy()
        self._fs, self._root = open_url(self.url, storage_options, policy)
        self._retry = Retrier(policy)
        self._writer: ThreadPoolExecutor | None = None  # started by the first write
        self._pending: list = []
        self._dir = join(self._root, rank_dir(self.rank))
        self._local = "file" in (self._fs.protocol if isinstance(self._fs.protocol, tuple) else (self._fs.protocol,))
        self._fs.makedirs(self._dir, exist_ok=True)
        self._steps: list[tuple[int, int, bool, int]] = []
        self._pieces: list[tuple[np.ndarray, ...]] = []
        self._passes: dict[int, dict] = {}  # pass summaries not yet written
        self._passes_seen: set[int] = set()
        self.generation = -1
        # a participant of a live membership whose restarts are its own (torchft's replica
        # groups): its generations void its own later steps only; with ``commits`` it records
        # which steps were committed (``commit``), and those past the last commit are void
        self.participant = False
        self.commits = False
        self.history: list | None = None  # the live-membership history, kept in every chunk
        self._committed: int | None = None
        self._committed_written: int | None = None
        self.start_generation(0, "fresh")
        _open_writers.add(self)

    # -- generations ---------------------------------------------------------------------
    def start_generation(self, resumed_at_step: int, mode: str, scope: str | None = None) -> int:
        """Begin a generation (a fresh start or a restart at ``resumed_at_step``); what is
        buffered belongs to the previous one and is written first. Returns its number.
        ``scope="participant"``: it voids this rank's later steps only (a batch put back);
        default: the whole job's, unless this writer is a ``participant``'s."""
        self.flush()
        # what this writer wrote is in the listing: a number is never reused once written
        self.generation = Topology(self.rank, self.world_size).agree_max(last_generation(self._fs, self._root) + 1)
        self._header = {
            "format": FORMAT, "version": VERSION, "rank": self.rank, "world_size": self.world_size,
            "generation": self.generation, "resumed_at_step": int(resumed_at_step), "mode": str(mode),
            "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "meta": self.meta,
        }
        self._scope = scope
        self._header_written = False
        self._seq = 0
        self._passes_seen = set()
        self._passes = {}
        return self.generation

    # -- records -------------------------------------------------------------------------
    def add(self, step: int, pass_idx: int, rows: RowBatch, skipped: bool = False) -> None:
        """Record one step's pieces (the batch's piece columns; no per-piece work)."""
        if pass_idx not in self._passes_seen:
            self._passes_seen.add(pass_idx)
            if self._describe_pass is not None:
                self._passes[pass_idx] = self._describe_pass(pass_idx)
        self._steps.append((int(step), int(pass_idx), bool(skipped), len(rows.start)))
        # references, not copies: a RowBatch's piece columns are built for it and only read
        # after (``expand``); ``flush`` copies them once, into the chunk
        self._pieces.append(piece_columns(rows))
        if len(self._steps) >= self.chunk_steps:
            self.flush(wait=False)

    def flush(self, wait: bool = True) -> None:
        """Write what is buffered as a new chunk, the generation header before the first one.

        The chunk is encoded here and, with ``wait=False`` (every ``chunk_steps`` steps), put by
        a background thread, in order. ``wait=True`` (the default, and what ``state_dict()``
        uses) waits for those, then puts this one itself (no hand-over to another thread on
        the checkpoint's path): it returns once every chunk so far is on storage, and raises if
        one could not be written after retries.

        A generation that records nothing leaves no header: its resume step rolls nothing
        back that matters, since a checkpoint it saves is at that same step (and a loader
        built, checkpointed and then resumed must not void the run it resumes)."""
        if wait:
            self._drain()
        if self.generation >= 0 and (self._steps or self._committed != self._committed_written):
            self._write_chunk(inline=wait)

    def commit(self, step: int, wait: bool = False) -> None:
        """Steps up to ``step`` were committed (trained): written now, with the steps buffered
        (in the background; ``wait=True``: on storage when this returns). A ledger that records
        commits voids the steps past the last one."""
        self.commits = True
        if self._committed is None or step > self._committed:
            self._committed = int(step)
            self.flush(wait=wait)

    def replan(self, pass_idx: int) -> None:
        """The plan of ``pass_idx`` changed (a membership change): described again with its
        next step."""
        self._passes_seen.discard(pass_idx)

    def _write_chunk(self, inline: bool) -> None:
        if not self._header_written:
            self._header["scope"] = self._scope or ("participant" if self.participant else "job")
            self._header["commits"] = self.commits
            where = join(join(self._root, GENERATIONS), f"gen-{self.generation:06d}")
            self._submit(join(where, f"{rank_dir(self.rank)}.json"), json.dumps(self._header, indent=1).encode(),
                         inline)
            self._header_written = True
        # two record arrays, not one array per column: savez costs ~60 us per array
        steps = np.array(self._steps, dtype=np.int64).reshape(-1, 4)
        step_table = np.empty(len(steps), STEP_DTYPE)
        for i, name in enumerate(STEP_COLUMNS):
            step_table[name] = steps[:, i]
        piece_table = np.empty(int(steps[:, 3].sum()), PIECE_DTYPE)
        for i, name in enumerate(PIECE_COLUMNS):
            if self._pieces:
                piece_table[name] = np.concatenate([p[i] for p in self._pieces])
        arrays = {"steps": step_table, "pieces": piece_table}
        info = {"rank": self.rank, "generation": self.generation, "seq": self._seq,
                "damaged": list(self._damaged()) if self._damaged is not None else [],
                "passes": {str(k): v for k, v in self._passes.items()}}
        if self._committed is not None:
            info["committed"] = self._committed
        if self.history is not None:
            info["membership"] = [list(map(int, e)) for e in self.history]
        self._committed_written = self._committed
        arrays["info"] = np.frombuffer(json.dumps(info).encode(), np.uint8)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        self._submit(join(self._dir, f"gen-{self.generation:06d}-{self._seq:06d}.npz"), buf.getvalue(), inline)
        self._seq += 1
        self._steps, self._pieces, self._passes = [], [], {}

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            _open_writers.discard(self)

    def __del__(self) -> None:  # a loader dropped after a `break`: its last steps were delivered
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer; at worst the tail is missing
            pass

    def _submit(self, path: str, data: bytes, inline: bool) -> None:
        def write() -> None:
            self._retry(lambda: self._put(path, data), f"writing {path}")

        if inline:
            write()
            return
        try:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="streamforge-ledger")
            self._pending.append(self._writer.submit(write))
        except RuntimeError:  # interpreter shutdown: no new threads; write here, after the others
            self._drain()
            write()

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()  # the first failure raises (a StorageError naming the object)

    def _put(self, path: str, data: bytes) -> None:
        if self._local:  # a rename is atomic on local disk: readers never see half a file
            folder, name = path.rsplit("/", 1)
            self._fs.makedirs(folder, exist_ok=True)
            tmp = join(folder, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
            self._fs.pipe_file(tmp, data)
            self._fs.mv(tmp, path)
        else:
            self._fs.pipe_file(path, data)


# Writers still holding steps at interpreter exit write them (a clean exit after a `break`
# while the loader is still referenced).
_open_writers: "weakref.WeakSet[LedgerWriter]" = weakref.WeakSet()


@atexit.register
def _flush_open_writers() -> None:
    for writer in list(_open_writers):
        try:
            writer.flush()
        except Exception:  # noqa: BLE001 - best effort at exit; the steps were delivered anyway
            pass


