"""PackedTokenDataset: streams in, packed token blocks out.

One worker's pipeline (``WorkerPipeline``)::

    plan -> ShardReader -> ShuffleBuffer  (one pair per stream)
                                   \\
                                    Interleaver (token-share deficit) -> Packer -> RowBatch

The dataset object holds configuration and the manifests (read once, in the constructing
process; worker processes receive them pickled, so nothing is re-read or listed). Iterated
directly, it is a torch ``IterableDataset`` yielding one block (a dict of tensors) at a
time; ``StreamingLoader`` drives the same pipelines in bulk and tracks resumable state.
"""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ..loader import collector
from .batch import RowBatch, pad_to_rows
from .blocks import BlockIterator
from ..errors import ConfigError, ResumeMismatchError
from .evaluation import EvalPipeline, EvalPlan, build_eval_plan, check_eval_config
from ..format.manifest import Manifest
from ..source import ShardSource
from ..planning.plan import PassPlan
from ..planning.planner import Planner, worker_work
from ..planning.schedule import MixtureSchedule
from ..stages.base import check_state
from ..stages.interleave import Interleaver
from ..stages.pack import MODES, Packer
from ..stages.read import ShardReader
from ..stages.shuffle import ShuffleBuffer
from ..resume.state import saved_config
from ..storage.config import StorageConfig
from ..storage.fetch import ByteFetcher

BOUNDARIES = ("document", "stream")


@dataclass
class Stream:
    """One source of documents: a stream URL, its mixing weight and a stable name.

    The name (default: ``stream<i>``, its position) keys seeds and state; the URL never
    does, so the same corpus copied elsewhere gives the same batches.
    """

    url: str
    weight: float = 1.0
    name: str | None = None
    storage_options: dict[str, Any] | None = None

    def __repr__(self) -> str:  # storage options hold keys and tokens: never printed
        options = None if self.storage_options is None else _masked(self.storage_options)
        return f"Stream(url={self.url!r}, weight={self.weight!r}, name={self.name!r}, storage_options={options!r})"


_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "auth", "session", "signature")


def _masked(options: Any) -> Any:
    """``options`` with the value of every key that names a secret replaced by ``'***'``."""
    if isinstance(options, dict):
        return {k: "***" if any(w in str(k).lower() for w in _SECRET_WORDS) and v is not None and not isinstance(
            v, (dict, list, bool)) else _masked(v) for k, v in options.items()}
    if isinstance(options, list):
        return [_masked(v) for v in options]
    return options


@dataclass(frozen=True)
class PipelineConfig:
    seq_len: int
    seed: int
    shuffle_buffer: int
    shuffle_warmup: int
    packing: str
    boundary: str
    eos_id: int | None
    pad_id: int
    infinite: bool
    provenance: bool
    bestfit_window: int

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ConfigError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.shuffle_buffer < 1:
            raise ConfigError(f"shuffle_buffer must be >= 1 document, got {self.shuffle_buffer}")
        if self.shuffle_warmup < 0:
            raise ConfigError(f"shuffle_warmup must be >= 0 documents (0: no warm-up), got {self.shuffle_warmup}")
        if self.packing not in MODES:
            raise ConfigError(f"packing must be one of {MODES}, got {self.packing!r}")
        if self.boundary not in BOUNDARIES:
            raise ConfigError(f"boundary must be one of {BOUNDARIES}, got {self.boundary!r}")
        if self.bestfit_window < 1:
            raise ConfigError(f"bestfit_window must be >= 1, got {self.bestfit_window}")


def whole(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, refused with ``ConfigError`` unless it is a whole number (not a
    bool, a float or a string: ``1.5`` once became ``1`` silently) and at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def resolve_topology(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): explicit values, else torch.distributed, else RANK/WORLD_SIZE, else 0/1."""
    if rank is None or world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank() if rank is None else rank
            world_size = torch.distributed.get_world_size() if world_size is None else world_size
        else:
            rank = int(os.environ.get("RANK", 0)) if rank is None else rank
            world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in 0..world_size-1 (world_size {world_size})")
    return int(rank), int(world_size)


def _refuse_empty_streams(streams: Sequence[Stream], manifests: Sequence[Manifest]) -> None:
    """An infinite pipeline over a stream without a document would re-plan its passes
    forever, finding nothing: refuse it up front, naming the stream."""
    for s, m in zip(streams, manifests):
        docs = m.columns.get("num_docs")
        if m.num_tokens == 0 or (docs is not None and int(docs.sum()) == 0):
            raise ConfigError(
                f"stream {s.name!r} ({s.url}) has no document with a token ({m.num_shards} shard(s), "
                f"{m.num_records} record(s), {m.num_tokens} tokens): an infinite pass over it would never "
                "end; drop the stream or use infinite=False"
            )


def _normalize_streams(streams: Any, scheduled: bool = False) -> list[Stream]:
    if isinstance(streams, (str, os.PathLike, Stream)):
        streams = [streams]
    out = [s if isinstance(s, Stream) else Stream(str(s)) for s in streams]
    if not out:
        raise ConfigError("at least one stream is needed")
    names = [s.name or f"stream{i}" for i, s in enumerate(out)]
    if len(set(names)) != len(names):
        raise ConfigError(f"stream names must be unique, got {names}")
    seen: dict[str, str] = {}
    for s, name in zip(out, names):
        url = str(s.url).rstrip("/")
        if url in seen:
            warnings.warn(f"streamforge: streams {seen[url]!r} and {name!r} read the same URL {url}: its documents "
                          "come twice per pass, once under each name", stacklevel=3)
        seen.setdefault(url, name)
    for s in out:
        if not s.weight >= 0:
            raise ConfigError(f"stream {s.name or s.url}: weight must be >= 0, got {s.weight}")
    if sum(s.weight for s in out) <= 0 and not scheduled:
        raise ConfigError("at least one stream needs a positive weight")
    return [Stream(str(s.url), float(s.weight), n, s.storage_options) for s, n in zip(out, names)]


class PackedTokenDataset(IterableDataset):
    """Fixed-length token blocks with document masks from one or more weighted streams."""

    def __init__(
        self,
        streams: Stream | str | Sequence[Stream | str],
        *,
        seq_len: int,
        seed: int = 0,
        shuffle_buffer: int = 8192,
        shuffle_warmup: int = 256,
        packing: str = "concat",
        boundary: str = "document",
        eos_id: int | None = None,
        pad_id: int = 0,
        infinite: bool = False,
        provenance: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        bestfit_window: int = 512,
        storage: StorageConfig | None = None,
        manifests: Sequence[Manifest] | None = None,
        share_manifests: bool = True,
        weights: Any = None,
        temperature: float = 1.0,
        evaluation: bool = False,
        eval_tokens: int | None = None,
    ) -> None:
        """``weights`` overrides the streams' own weights: a ``{name: weight}`` mapping, or a
        schedule ``[(first_step, {name: weight}), ...]`` keyed by global step (see
        ``docs/mixing.md``); ``temperature`` reshapes every phase as ``w ** (1/temperature)``.

        ``evaluation=True`` makes an evaluation dataset (``docs/eval.md``): every token of
        every stream once per pass, in the same rows on any topology, no shuffle, no
        weights; ``eval_tokens`` keeps the first that many tokens (whole rows)."""
        self.resume_generation = 0  # statistical resumes behind this job (set by the loader)
        self.evaluation = bool(evaluation)
        self.eval_tokens = None if eval_tokens is None else int(eval_tokens)
        if self.evaluation:
            check_eval_config(packing, infinite, eval_tokens)
        elif eval_tokens is not None:
            raise ConfigError("eval_tokens applies to evaluation datasets only (evaluation=True)")
        self.streams = _normalize_streams(streams, weights is not None or self.evaluation)
        self.storage = storage or StorageConfig()
        self.manifests = (
            list(manifests) if manifests is not None else self._load_manifests(share_manifests)
        )
        # Streams tokenized from text must share one tokenizer (same file, by sha256).
        tokenized = [(s.name or s.url, m.tokenizer) for s, m in zip(self.streams, self.manifests) if m.tokenizer]
        for name, tok in tokenized[1:]:
            if tok.get("sha256") != tokenized[0][1].get("sha256"):
                first, info = tokenized[0]
                raise ConfigError(
                    f"streams {first!r} and {name!r} were tokenized with different tokenizers: "
                    f"{info.get('kind')} {info.get('name')} (sha256 {info.get('sha256')}) and "
                    f"{tok.get('kind')} {tok.get('name')} (sha256 {tok.get('sha256')})"
                )
        eos = self._resolve_eos(eos_id)
        self.config = PipelineConfig(
            seq_len=whole("seq_len", seq_len, 1), seed=whole("seed", seed, 0),
            shuffle_buffer=whole("shuffle_buffer", shuffle_buffer, 1),
            shuffle_warmup=whole("shuffle_warmup", shuffle_warmup, 0),
            packing=packing, boundary=boundary, eos_id=eos, pad_id=whole("pad_id", pad_id, 0),
            infinite=bool(infinite), provenance=bool(provenance),
            bestfit_window=whole("bestfit_window", bestfit_window, 1),
        )
        self._check_token_ids()
        if self.config.infinite:
            _refuse_empty_streams(self.streams, self.manifests)
        self.rank, self.world_size = resolve_topology(rank, world_size)
        widest = max(np.dtype(m.token_dtype).itemsize for m in self.manifests)
        self.token_dtype = np.dtype(f"<u{widest}")
        self.schedule = MixtureSchedule.build(self.stream_names, self.weights, weights, temperature)
        self.planner = Planner(self.stream_names, self.manifests, seed=self.config.seed, sources=self._index_source)
        self._index_sources: dict[int, ShardSource] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_index_sources"] = {}  # per process: opened where the indexes are read
        return state

    def _index_source(self, stream: int) -> ShardSource:
        """The source the planner reads record indexes through (one per stream, lazily)."""
        source = self._index_sources.get(stream)
        if source is None:
            source = self._index_sources[stream] = self.open_source(stream)
        return source

    def open_source(self, stream: int) -> ShardSource:
        """A new reader of stream ``stream``'s shards (ranged reads, prefetch, cache), holding
        the record indexes already read in this process (``keep_indexes``), with the
        stream's share of a pipeline's read-ahead (``read_shares``)."""
        s = self.streams[stream]
        fetcher = ByteFetcher(s.url, s.storage_options, self.storage.retry, self.storage.hedge, self.storage.client)
        source = ShardSource(self.manifests[stream], fetcher, config=self.storage,
                             read_share=self.read_shares[stream])
        shared = self._index_sources.get(stream)
        if shared is not None:
            source.adopt_indexes(shared)
        return source

    def keep_indexes(self, sources: Sequence[ShardSource]) -> None:
        """Keep the record indexes ``sources`` (one per stream, e.g. a pipeline's that is done)
        have read, for the sources opened after them in this process."""
        for i, source in enumerate(sources):
            self._index_source(i).adopt_indexes(source)

    def with_storage(self, storage: StorageConfig) -> PackedTokenDataset:
        """This dataset reading with other storage settings, sharing the record indexes read in
        this process."""
        other = copy.copy(self)
        other.storage = storage
        other._index_sources = self._index_sources
        return other

    @property
    def read_shares(self) -> list[float]:
        """Each stream's share of a pipeline's read-ahead: its largest weight in the
        schedule, normalized over the streams (even shares where no stream has weight)."""
        top = [max(phase[i] for phase in self.schedule.weights) for i in range(len(self.streams))]
        total = sum(top)
        return [t / total for t in top] if total > 0 else [1 / len(top)] * len(top)

    @property
    def eos_appended(self) -> list[bool]:
        """Per stream: does the pipeline append EOS to its documents?"""
        return [self.config.eos_id is not None and not m.docs_end_with_eos for m in self.manifests]

    def pass_plan(
        self, pass_idx: int, *, workers_per_rank: int, batch_size: int, first_step: int = 0,
        fractions: Sequence[float] | None = None,
    ) -> PassPlan | EvalPlan:
        """The plan of ``pass_idx`` for this job's topology (see ``plan.PassPlan``); with
        ``fractions``, of what is left of it (``Planner.pass_plan``). An evaluation dataset
        has one pass, the same every time (``evaluation.EvalPlan``)."""
        if self.evaluation:
            return build_eval_plan(
                self.planner, eos_appended=self.eos_appended, world_size=self.world_size,
                workers_per_rank=workers_per_rank, batch_size=batch_size, seq_len=self.config.seq_len,
                packing=self.config.packing, eval_tokens=self.eval_tokens,
            )
        return self.planner.pass_plan(
            pass_idx, world_size=self.world_size, workers_per_rank=workers_per_rank,
            batch_size=batch_size, seq_len=self.config.seq_len, packing=self.config.packing,
            eos_appended=self.eos_appended, first_step=first_step, fractions=fractions,
        )

    def _load_manifests(self, share: bool) -> list[Manifest]:
        """Each stream's manifest, read once per job: with torch.distributed initialized (and
        ``share``), rank 0 reads them and broadcasts them, so every rank must build the
        dataset; an error on rank 0 is raised on every rank."""

        def load() -> list[Manifest]:
            with collector.paused():  # a manifest of many shards is many small objects
                return [Manifest.load(s.url, s.storage_options, retry=self.storage.retry, client=self.storage.client)
                        for s in self.streams]

        dist = torch.distributed
        if not share or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return load()
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = load()
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                box[0] = exc
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def _check_token_ids(self) -> None:
        """EOS and pad ids fit every stream's token dtype (and vocabulary, where known)."""
        for name, value in (("eos_id", self.config.eos_id), ("pad_id", self.config.pad_id)):
            if value is None:
                continue
            for s, m in zip(self.streams, self.manifests):
                top = int(np.iinfo(m.token_dtype).max) if m.token_dtype in ("uint16", "uint32") else None
                if top is not None and value > top:
                    raise ConfigError(f"{name} {value} does not fit stream {s.name!r}'s tokens ({m.token_dtype}, "
                                      f"at most {top})")
                if name == "eos_id" and m.vocab_size is not None and value >= m.vocab_size:
                    raise ConfigError(f"eos_id {value} is outside stream {s.name!r}'s vocabulary "
                                      f"(vocab_size {m.vocab_size})")

    def _resolve_eos(self, eos_id: int | None) -> int | None:
        """The EOS id appended to documents that lack one (None: nothing to append)."""
        need = [s.name for s, m in zip(self.streams, self.manifests) if not m.docs_end_with_eos]
        if eos_id is not None:
            return whole("eos_id", eos_id, 0)
        known = {m.eos_id for m in self.manifests if m.eos_id is not None}
        if len(known) > 1:
            raise ConfigError(f"streams disagree on eos_id ({sorted(known)}); pass eos_id=")
        if need and not known:
            raise ConfigError(
                f"streams {need} have documents without a trailing EOS and no eos_id is known "
                "(none in their manifests); pass eos_id="
            )
        return known.pop() if (need and known) else None

    @property
    def stream_names(self) -> list[str]:
        return [s.name for s in self.streams]

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.streams]

    def describe(self) -> dict[str, Any]:
        """Everything the batch sequence depends on, apart from the loader's batch size and
        workers (plain data; the basis of resume fingerprints)."""
        return {
            "streams": [
                {"name": s.name, "weight": s.weight, "manifest": m.fingerprint}
                for s, m in zip(self.streams, self.manifests)
            ],
            "mixture": self.schedule.describe(),
            "world_size": self.world_size,
            # shuffle_warmup=0 is left out: states saved before it existed had full windows
            **saved_config(asdict(self.config)),
            **({"evaluation": True, "eval_tokens": self.eval_tokens} if self.evaluation else {}),
        }

    # -- pipelines -------------------------------------------------------------------------
    def make_pipeline(
        self, worker: int, num_workers: int, first_pass: int = 0, *,
        quota: int | None = None, first_step: int = 0, plan: PassPlan | EvalPlan | None = None,
    ) -> WorkerPipeline | EvalPipeline:
        """Worker ``worker``'s pipeline; an evaluation dataset's follows ``plan`` (by default
        the plan for ``num_workers`` workers per rank and batches of one row)."""
        if self.evaluation:
            if not isinstance(plan, EvalPlan):
                plan = self.pass_plan(0, workers_per_rank=num_workers, batch_size=1)
            return EvalPipeline(self, worker, num_workers, plan)
        work = plan if isinstance(plan, PassPlan) and plan.windows is not None else None
        return WorkerPipeline(self, worker, num_workers, first_pass, quota=quota, first_step=first_step, work=work)

    def __iter__(self) -> BlockIterator:
        """The calling worker's blocks, with ``state_dict``/``load_state_dict`` (blocks.py)."""
        return BlockIterator(self)


class WorkerPipeline:
    """The stages of one global worker, with their joint state, on the job clock.

    The pipeline builds its worker's batches of the rank's sequence: its ``j``-th batch has
    global step ``first_step + j * W + worker`` (``plan.PassPlan.step_of``); the interleaver
    is told that step before the batch is built. In a finite pass, ``quota`` is the number of
    batches this worker builds (``PassPlan.batches_of``); every one is full. ``work`` is the
    plan of the rest of a pass after an elastic resume (``elastic.py``): in that pass the
    worker reads its share of the work left, saved windows' rests first.
    """

    def __init__(
        self, dataset: PackedTokenDataset, worker: int, num_workers: int, first_pass: int, *,
        quota: int | None = None, first_step: int = 0, work: PassPlan | None = None,
    ) -> None:
        cfg = dataset.config
        self.dataset = dataset
        self.worker = worker
        self.num_workers = num_workers
        self.global_worker = dataset.rank * num_workers + worker
        self.num_global_workers = dataset.world_size * num_workers
        self.quota = quota
        self.first_step = first_step
        self.batches = 0  # batches built in this pass (since the start, when infinite)
        self.padded_rows = 0
        self.sources = []
        buffers = []
        assigned = None if work is None else list(zip(work.ranges, work.windows))
        for i, stream in enumerate(dataset.streams):
            source = dataset.open_source(i)
            ranges_for, windows_for = worker_work(
                dataset.planner, i, self.num_global_workers, self.global_worker, -1 if work is None else work.pass_idx,
                assigned,
            )
            reader = ShardReader(
                source, ranges_for=ranges_for, stream_key=stream.name, infinite=cfg.infinite,
                first_pass=first_pass,
            )
            eos = cfg.eos_id if dataset.eos_appended[i] else None
            buffers.append(ShuffleBuffer(
                reader, size=cfg.shuffle_buffer, seed=cfg.seed, stream_key=stream.name,
                global_worker=self.global_worker, eos_id=eos, windows_for=windows_for,
                generation=dataset.resume_generation, warmup=cfg.shuffle_warmup,
            ))
            self.sources.append(source)
        self.buffers = buffers
        self.interleaver = Interleaver(buffers, dataset.schedule)
        self.packer = Packer(
            self.interleaver, seq_len=cfg.seq_len, mode=cfg.packing, pad_id=cfg.pad_id,
            dtype=dataset.token_dtype, bestfit_window=cfg.bestfit_window,
        )

    @property
    def step(self) -> int:
        """The global step of the next batch this pipeline builds."""
        return self.first_step + self.batches * self.num_workers + self.worker

    def next_batch(self, num_rows: int, out: np.ndarray | None = None) -> RowBatch | None:
        """The next batch, or None when this worker's share of the pass is done. With a
        quota, a batch the data cannot fill (records skipped as damaged) is padded to full
        shape, counted in ``stats()["padded_rows"]``, so every rank still has every step.
        ``out``: where to build the tokens, if the batch fits (``Packer.next_rows``)."""
        if self.quota is not None and self.batches >= self.quota:
            return None
        self.interleaver.set_step(self.first_step + self.batches * self.num_workers + self.worker)
        rows = self.packer.next_rows(num_rows, out)
        if self.quota is not None:
            got = 0 if rows is None else rows.num_rows
            if got < num_rows:
                self.padded_rows += num_rows - got
                rows = pad_to_rows(rows, num_rows, self.dataset.config.seq_len, self.dataset.token_dtype,
                                   self.dataset.config.pad_id)
        if rows is None:
            return None
        self.batches += 1
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "packer": self.packer.state_dict()}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ResumeMismatchError`` naming the stage and value a state gets wrong
        (reads record indexes, never tokens; leaves this pipeline unusable)."""
        self._check_own(state)
        self.packer.check_state(state["packer"])

    def _check_own(self, state: dict[str, Any]) -> None:
        check_state(state, ("batches", "packer"), "WorkerPipeline")
        batches = int(state["batches"])
        if batches < 0 or (self.quota is not None and batches > self.quota):
            raise ResumeMismatchError(
                f"WorkerPipeline: worker {self.worker} has built {batches} batches, outside "
                f"0..{self.quota} of this pass"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_own(state)
        self.batches = int(state["batches"])
        self.packer.load_state_dict(state["packer"])

    @staticmethod
    def stream_states(state: dict[str, Any]) -> list[dict[str, Any]]:
        """Each stream's shuffle-buffer state nested in a saved pipeline state."""
        check_state(state, ("batches", "packer"), "WorkerPipeline")
        return Interleaver.source_states(Packer.source_state(state["packer"]))

    def seek(self, positions: Sequence[tuple[int, int]]) -> None:
        """Start each stream ``records`` into this worker's ranges of ``pass`` (one
        ``(pass, records)`` per stream), at a window boundary; used by statistical resume."""
        for buffer, (pass_idx, records) in zip(self.buffers, positions):
            buffer.seek(pass_idx, records)
        self.interleaver.forget_schedule()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"truncated_tokens": self.packer.truncated_tokens, "padded_rows": self.padded_rows}
        for stream, source in zip(self.dataset.streams, self.sources):
            stats = source.stats() if callable(getattr(source, "stats", None)) else {}
            out[stream.name] = stats
        return out

    def skipped(self) -> list[dict[str, Any]]:
        out = []
        for stream, source in zip(self.dataset.streams, self.sources):
            for item in getattr(source, "skipped", []) or []:
                out.append({"stream": stream.name, **item})
        return out

    def close(self) -> None:
        for source in self.sources:
            close = getattr(source, "close", None)
            if close is not None:
                close()
