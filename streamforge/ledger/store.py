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
import operator
import os
import re
import socket
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..pipeline.batch import RowBatch
from ..planning.steps import StepSchedule
from ..errors import LedgerError
from ..storage.config import RetryPolicy
from ..storage.open import join, open_url
from ..storage.retry import Retrier
from ..topology import Topology

FORMAT = "streamforge-ledger"
VERSION = 1
DEFAULT_CHUNK_STEPS = 256
_GEN = re.compile(r"gen-(\d{6,})")
_HEADER = re.compile(r"rank(\d{5,})\.json")  # generations/gen-NNNNNN/rankNNNNN.json
_CHUNK = re.compile(r"gen-(\d{6,})-(\d{6,})\.npz")  # rankNNNNN/gen-NNNNNN-SSSSSS.npz
_RANK = re.compile(r"rank(\d{5,})")
GENERATIONS = "generations"

# per piece, as stored: name -> dtype (the RowBatch field of the same name)
PIECE_COLUMNS = {
    "start": np.int64, "length": np.int64, "stream": np.int16, "shard": np.int32,
    "record": np.int64, "token_start": np.int64, "continues": np.bool_,
}
# per step: name -> dtype
STEP_COLUMNS = {"step": np.int64, "pass": np.int32, "skipped": np.bool_, "num_pieces": np.int64}

STEP_DTYPE = np.dtype(list(STEP_COLUMNS.items()))
PIECE_DTYPE = np.dtype(list(PIECE_COLUMNS.items()))
_piece_columns = operator.attrgetter(*PIECE_COLUMNS)


def rank_dir(rank: int) -> str:
    return f"rank{rank:05d}"


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
        self.start_generation(0, "fresh")
        _open_writers.add(self)

    # -- generations ---------------------------------------------------------------------
    def start_generation(self, resumed_at_step: int, mode: str) -> int:
        """Begin a generation (a fresh start or a restart at ``resumed_at_step``); what is
        buffered belongs to the previous one and is written first. Returns its number."""
        self.flush()
        # what this writer wrote is in the listing: a number is never reused once written
        self.generation = Topology(self.rank, self.world_size).agree_max(_last_generation(self._fs, self._root) + 1)
        self._header = {
            "format": FORMAT, "version": VERSION, "rank": self.rank, "world_size": self.world_size,
            "generation": self.generation, "resumed_at_step": int(resumed_at_step), "mode": str(mode),
            "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "meta": self.meta,
        }
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
        self._pieces.append(_piece_columns(rows))
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
        if self.generation >= 0 and self._steps:
            self._write_chunk(inline=wait)

    def _write_chunk(self, inline: bool) -> None:
        if not self._header_written:
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
            piece_table[name] = np.concatenate([p[i] for p in self._pieces])
        arrays = {"steps": step_table, "pieces": piece_table}
        info = {"rank": self.rank, "generation": self.generation, "seq": self._seq,
                "damaged": list(self._damaged()) if self._damaged is not None else [],
                "passes": {str(k): v for k, v in self._passes.items()}}
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


def _last_generation(fs, root: str) -> int:
    """The largest generation number with a header under ``root`` (-1: none). One listing
    of ``generations/`` (a folder per generation), however many chunks the ledger holds."""
    folder = join(root, GENERATIONS)
    fs.invalidate_cache(folder)
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False)]
    except FileNotFoundError:
        return -1
    return max((int(m.group(1)) for n in names if (m := _GEN.fullmatch(n))), default=-1)


def _list(fs, root: str) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, int, str]]]:
    """Headers ``(generation, rank, path)`` and chunks ``(generation, rank, seq, path)``
    under ``root``; anything else (temporary files, other names) is left out."""
    fs.invalidate_cache(root)
    try:
        paths = fs.find(root)
    except FileNotFoundError:
        return [], []
    headers, chunks = [], []
    for path in paths:
        parts = path.rstrip("/").rsplit("/", 3)
        if len(parts) < 3:
            continue
        if len(parts) == 4 and parts[1] == GENERATIONS and (g := _GEN.fullmatch(parts[2])) and (
                r := _HEADER.fullmatch(parts[3])):
            headers.append((int(g.group(1)), int(r.group(1)), path))
        elif (r := _RANK.fullmatch(parts[-2])) and (c := _CHUNK.fullmatch(parts[-1])):
            chunks.append((int(c.group(1)), int(r.group(1)), int(c.group(2)), path))
    return sorted(headers), sorted(chunks)


# -- reading ----------------------------------------------------------------------------------
@dataclass
class Ledger:
    """A ledger as read: the effective steps and pieces (after rollback) as numpy columns.

    ``steps``: step, pass, skipped, num_pieces, rank, generation (one entry per rank and step).
    ``pieces``: the ``PIECE_COLUMNS`` plus step, pass, skipped, rank, generation of their step.
    ``generations``: every header, ordered; ``restarts``: the generations grouped by restart
    (``group_restarts``). ``rolled_back``: the steps (one per rank) a later restart voided.
    ``damaged``: records skipped as damaged, with the pass and rank that met them.
    ``passes``: pass -> plan summary. ``problems``: inconsistencies found while reading.
    """

    steps: dict[str, np.ndarray]
    pieces: dict[str, np.ndarray]
    generations: list[dict[str, Any]]
    restarts: list[dict[str, Any]]
    rolled_back: dict[str, np.ndarray]
    damaged: list[dict[str, Any]] = field(default_factory=list)
    passes: dict[int, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def meta(self) -> dict[str, Any]:
        """The meta of the latest generation (``{}`` for an empty ledger)."""
        return self.generations[-1]["meta"] if self.generations else {}

    @property
    def stream_names(self) -> list[str]:
        return [s["name"] for s in self.meta.get("streams", [])]

    @property
    def seq_len(self) -> int:
        value = self.meta.get("seq_len", 0)
        return int(value) if not isinstance(value, list) else max(v for _, v in value)

    def seq_len_at(self, step: int) -> int:
        """The row length at ``step`` (a seq_len schedule is kept as ``[[step, seq_len], ...]``)."""
        value = self.meta.get("seq_len", 0)
        return int(value) if not isinstance(value, list) else StepSchedule.build("seq_len", value).at(step)


def read_ledger(url: str, storage_options: dict[str, Any] | None = None) -> Ledger:
    """Every chunk and header under ``url``, with the rollback of each restart applied."""
    fs, root = open_url(str(url), storage_options)
    header_paths, chunks = _list(fs, root)
    headers = {(g, r): json.loads(blob) for (g, r, _), blob in
               zip(header_paths, _read_many(fs, [p for _, _, p in header_paths]))}
    if not headers and not chunks:
        if not fs.exists(root):
            raise LedgerError(f"{url}: no ledger here (the path does not exist)")
        raise LedgerError(f"{url}: no ledger here (no {GENERATIONS}/gen-*/rank*.json or rank*/gen-*.npz)")
    problems: list[str] = []
    blobs = _read_many(fs, [c[3] for c in chunks])
    step_parts, piece_parts, damaged, passes = [], [], [], {}
    for (gen, rank, seq, path), blob in zip(chunks, blobs):
        if (gen, rank) not in headers:
            problems.append(f"{path}: chunk of generation {gen} on rank {rank} without its header")
        steps, pieces, info = _decode_chunk(path, blob)
        if (info.get("generation"), info.get("rank")) != (gen, rank):
            problems.append(f"{path}: the chunk says generation {info.get('generation')} of rank "
                            f"{info.get('rank')}; its name says generation {gen} of rank {rank}")
        for column in (steps, pieces):
            column["rank"] = np.full(len(column["step"]), rank, np.int32)
            column["generation"] = np.full(len(column["step"]), gen, np.int32)
        step_parts.append(steps)
        piece_parts.append(pieces)
        last_pass = int(steps["pass"][-1]) if len(steps["pass"]) else None
        damaged += [{**d, "pass": last_pass, "rank": rank} for d in info.get("damaged", [])]
        for k, v in info.get("passes", {}).items():
            passes.setdefault(int(k), []).append({**v, "generation": gen})
    piece_columns = {**PIECE_COLUMNS, **{k: v for k, v in STEP_COLUMNS.items() if k != "num_pieces"}}
    steps, pieces = _concat(step_parts, STEP_COLUMNS), _concat(piece_parts, piece_columns)
    generations = sorted(headers.values(), key=lambda h: (h["generation"], h["time"], h["rank"]))
    restarts = group_restarts(generations)
    keep_steps = _effective(steps, restarts)
    keep_pieces = _effective(pieces, restarts)
    rolled_back = {k: v[~keep_steps] for k, v in steps.items()}
    return Ledger(
        steps={k: v[keep_steps] for k, v in steps.items()},
        pieces={k: v[keep_pieces] for k, v in pieces.items()},
        generations=generations, restarts=restarts, rolled_back=rolled_back, damaged=_unique(damaged),
        passes={p: _full_plan(items) for p, items in sorted(passes.items())}, problems=problems,
    )


def _read_many(fs, paths: list[str]) -> list[bytes]:
    if not paths:
        return []
    out = fs.cat(paths)  # one batched call: concurrent on object stores
    return [out[p] if p in out else out[fs._strip_protocol(p)] for p in paths]


def _decode_chunk(path: str, blob: bytes) -> tuple[dict, dict, dict]:
    try:
        with np.load(io.BytesIO(blob)) as z:
            arrays = {k: z[k] for k in z.files}
        info = json.loads(arrays["info"].tobytes())
        steps = {name: np.ascontiguousarray(arrays["steps"][name], dtype) for name, dtype in STEP_COLUMNS.items()}
        pieces = {name: np.ascontiguousarray(arrays["pieces"][name], dtype) for name, dtype in PIECE_COLUMNS.items()}
    except (OSError, ValueError, KeyError) as exc:
        raise LedgerError(f"{path}: not a readable ledger chunk ({exc})") from exc
    counts = steps["num_pieces"]
    if int(counts.sum()) != len(pieces["start"]):
        raise LedgerError(f"{path}: {int(counts.sum())} pieces announced by its steps, {len(pieces['start'])} stored")
    for name in ("step", "pass", "skipped"):
        pieces[name] = np.repeat(steps[name], counts)
    return steps, pieces, info


def _concat(parts: list[dict], columns: dict) -> dict[str, np.ndarray]:
    columns = {**columns, "rank": np.int32, "generation": np.int32}
    if not parts:
        return {n: np.zeros(0, dtype) for n, dtype in columns.items()}
    return {n: np.concatenate([p[n] for p in parts]) for n in columns}


def group_restarts(generations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The restarts of the job, in order: each folds the headers of one or more generations
    (``generations``: their numbers, ``ranks``, ``resumed_at_step``, ``mode``, ``world_size``,
    ``time``). Adjacent generations that resumed at the same step on disjoint ranks are one
    restart whose ranks raced for the number (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for number in sorted({int(h["generation"]) for h in generations}):
        mine = [h for h in generations if int(h["generation"]) == number]
        ranks = {int(h["rank"]) for h in mine}
        step = min(int(h["resumed_at_step"]) for h in mine)
        last = out[-1] if out else None
        if last is not None and last["resumed_at_step"] == step and not ranks & set(last["ranks"]):
            last["generations"].append(number)
            last["ranks"] = sorted(set(last["ranks"]) | ranks)
            continue
        h = mine[0]
        out.append({"generations": [number], "ranks": sorted(ranks), "resumed_at_step": step, "mode": h["mode"],
                    "world_size": int(h["world_size"]), "time": min(x["time"] for x in mine)})
    return out


def rollback_cutoffs(restarts: list[dict[str, Any]], numbers) -> dict[int, float]:
    """generation -> the first step voided in it: the smallest step any later restart
    resumed at (infinity when none did). ``numbers``: the generations to answer for; one
    without a header (a lost header) is voided by the restarts numbered after it."""
    restart_of = {g: i for i, r in enumerate(restarts) for g in r["generations"]}
    out = {}
    for g in numbers:
        g = int(g)
        if g in restart_of:
            later = restarts[restart_of[g] + 1:]
        else:
            later = [r for r in restarts if min(r["generations"]) > g]
        out[g] = min((r["resumed_at_step"] for r in later), default=float("inf"))
    return out


def _effective(columns: dict[str, np.ndarray], restarts: list[dict[str, Any]]) -> np.ndarray:
    """Mask of the records no later restart rolled back."""
    numbers, inverse = np.unique(columns["generation"], return_inverse=True)
    cutoffs = rollback_cutoffs(restarts, numbers.tolist())
    limits = np.array([cutoffs[g] for g in numbers.tolist()], dtype=np.float64)
    return columns["step"] < limits[inverse] if len(numbers) else np.zeros(0, bool)


def _unique(items: list[dict]) -> list[dict]:
    seen, out = set(), []
    for item in items:
        key = json.dumps({k: v for k, v in item.items() if k != "rank"}, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


def _full_plan(items: list[dict]) -> dict:
    """A pass's plan summary: the latest one made from the whole pass, extended by the plans
    of what later resumes (elastic or statistical) left of it: the pass ends where the last of
    them ends, each re-plan adds its own drop bound, and the pass drops what the last one drops."""
    whole = [i for i in items if not i.get("remaining")]
    base = dict((whole or items)[-1])
    later = [i for i in items if i.get("remaining") and i["first_step"] >= base["first_step"]]
    if whole and later:
        last = later[-1]
        base["steps"] = last["first_step"] + last["steps"] - base["first_step"]
        base["drop_bound"] = base["drop_bound"] + sum(i["drop_bound"] for i in later)
        # the last re-plan holds all the work its predecessors left, their surplus included:
        # what it drops is what the pass drops
        base["dropped_tokens"] = last["dropped_tokens"]
        base["replans"] = len(later)
    return base
