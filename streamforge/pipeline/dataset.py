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
from dataclasses import asdict
from typing import Any, Sequence

import numpy as np
from torch.utils.data import IterableDataset

from ..loader import collector
from .blocks import BlockIterator
from ..errors import ConfigError
from .evaluation import EvalPipeline, EvalPlan, build_eval_plan, check_eval_config
from ..format.manifest import Manifest
from ..source import ShardSource
from ..planning.plan import PassPlan
from ..planning.planner import Planner
from ..planning.readings import reading_manifest
from ..planning.schedule import MixtureSchedule
from ..planning.steps import JobTokens, StepSchedule
from ..resume.state import saved_config
from ..planning.token_cuts import check_cuts, cut_spec
from ..storage.config import StorageConfig
from ..storage.fetch import ByteFetcher
from ..topology import Topology
from .config import (  # noqa: F401 - re-exported: the dataset's settings are imported from here too
    BOUNDARIES, PackingConfig, PipelineConfig, ShuffleConfig, Stream, _normalize_streams, _refuse_empty_streams,
    _PACKING, _SHUFFLE, _settings, scheduled, whole,
)
from ..stages.balance import balanced_target
from ..stages.window_order import window_size
from .foreign import refuse_foreign_sharding
from .repeats import check_readings, describe_readings, resolve_repeats
from .worker import WorkerPipeline  # noqa: F401 - re-exported


class PackedTokenDataset(IterableDataset):
    """Fixed-length token blocks with document masks from one or more weighted streams.

    Args:
        streams: stream URLs or ``Stream``s (URL, weight, name, storage options).
        seq_len: tokens per row: an int, or a schedule ``[(first_step, seq_len), ...]`` keyed
            by global step (a sequence-length warmup; ``planning/steps.py``, docs/schedules.md),
            which needs a ``StreamingLoader`` to run on the job clock.
        seed: the seed of every shuffle (with the stream, pass and worker).
        shuffle: the shuffle windows (``ShuffleConfig``); ``shuffle_buffer=`` and
            ``shuffle_warmup=`` are the older spelling and keep working.
        packing: ``"concat"``, ``"pad"``, ``"bestfit"`` or ``"balance"`` (rows of equal
            attention cost, docs/batch.md), or a ``PackingConfig`` (which also holds
            ``bestfit_window``, the older keyword, which keeps working).
        eos_id: the token appended to documents that lack one (default: the manifests').
        pad_id: the token of padding positions.
        infinite: passes follow each other without end, each stream on its own.
        cuts: ``"records"`` (default): the plan cuts each stream at record boundaries, and a
            finite pass drops what a worker holds past its last full batch; ``"tokens"``:
            at token positions inside documents, so every worker holds the tokens of its
            batches and a finite pass drops less than one global step (concat packing, one
            batch size and seq_len; ``planning/token_cuts.py``).
        rank, world_size: the data-parallel topology (default: torch.distributed's, else
            ``RANK``/``WORLD_SIZE``, else 0 of 1; ``streamforge.topology``).
        mesh, dp_dims: a hybrid-parallel job's ``DeviceMesh`` and the names of its
            data-parallel dimensions (default: ``batch`` where the mesh has it, else those of
            ``dp``, ``dp_replicate``, ``dp_shard`` it has); the data-parallel rank is the
            flattened coordinate over them and every other dimension holds replicas, which
            get the same batches (docs/parallelism.md).
        group: Megatron-style, without a mesh: the data-parallel ``ProcessGroup`` (with
            ``rank``/``world_size`` the rank in it and its size, or derived from it).
        storage: how shards are read (``StorageConfig``: client, retries, read-ahead, cache).
        manifests: the streams' manifests, already read (default: read them, on rank 0 under
            torch.distributed, with ``share_manifests``).
        weights: overrides the streams' own weights: a ``{name: weight}`` mapping, or a
            schedule ``[(first_step, {name: weight}), ...]`` keyed by global step
            (docs/mixing.md); a phase may carry an LR scale: ``(first_step, {name: weight},
            lr_scale)`` or ``Phase(first_step, weights, lr_scale)``.
        anneal: ``(step, {name: weight}[, lr_scale])``: from ``step`` the listed weights and
            every other stream at 0 (not together with a list of phases in ``weights``).
        temperature: reshapes every phase's weights as ``w ** (1/temperature)``.
        evaluation, eval_tokens: make an evaluation dataset; ``EvaluationDataset`` is the
            clearer spelling (docs/eval.md).
        boundary, provenance: how a batch is expanded when the dataset is iterated directly;
            a ``StreamingLoader`` takes them as its batch spec (these are its defaults).
    """

    def __init__(
        self,
        streams: Stream | str | Sequence[Stream | str],
        *,
        seq_len: int | Sequence[tuple[int, int]],
        seed: int = 0,
        shuffle: ShuffleConfig | None = None,
        packing: str | PackingConfig = "concat",
        shuffle_buffer: int = _SHUFFLE.buffer,
        shuffle_warmup: int = _SHUFFLE.warmup,
        boundary: str = "document",
        eos_id: int | None = None,
        pad_id: int = 0,
        infinite: bool = False,
        provenance: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        mesh: Any = None,
        dp_dims: Sequence[str] | str | None = None,
        group: Any = None,
        bestfit_window: int = _PACKING.bestfit_window,
        storage: StorageConfig | None = None,
        manifests: Sequence[Manifest] | None = None,
        share_manifests: bool = True,
        weights: Any = None,
        temperature: float = 1.0,
        anneal: Any = None,
        evaluation: bool = False,
        eval_tokens: int | None = None,
        cuts: str = "records",
    ) -> None:
        shuffle, pack = _settings(shuffle, packing, shuffle_buffer, shuffle_warmup, bestfit_window)
        packing = pack.mode
        self.resume_generation = 0  # statistical resumes behind this job (set by the loader)
        self.evaluation = bool(evaluation)
        self.eval_tokens = None if eval_tokens is None else int(eval_tokens)
        if self.evaluation:
            check_eval_config(packing, infinite, eval_tokens)
        elif eval_tokens is not None:
            raise ConfigError("eval_tokens applies to evaluation datasets only (evaluation=True)")
        self.streams = _normalize_streams(streams, weights is not None or anneal is not None or self.evaluation)
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
        self.seq_lens = scheduled("seq_len", seq_len)  # by step; config.seq_len is the longest
        if self.evaluation and self.seq_lens.constant is None:
            raise ConfigError("an evaluation dataset has one seq_len (an int), not a schedule: its pass is the same "
                              "at every step")
        self.config = PipelineConfig(
            seq_len=self.seq_lens.largest, seed=whole("seed", seed, 0),
            shuffle_buffer=whole("shuffle_buffer", shuffle.buffer, 1),
            shuffle_warmup=whole("shuffle_warmup", shuffle.warmup, 0),
            packing=packing, boundary=boundary, eos_id=eos, pad_id=whole("pad_id", pad_id, 0),
            infinite=bool(infinite), provenance=bool(provenance),
            bestfit_window=whole("bestfit_window", pack.bestfit_window, 1), cuts=cuts,
        )
        check_cuts(cuts, packing, self.seq_lens.constant is None)
        self._check_token_ids()
        if self.config.infinite:
            _refuse_empty_streams(self.streams, self.manifests)
        self.topology = Topology.build(rank, world_size, mesh=mesh, dp_dims=dp_dims, group=group)
        widest = max(np.dtype(m.token_dtype).itemsize for m in self.manifests)
        self.token_dtype = np.dtype(f"<u{widest}")
        self.schedule = MixtureSchedule.build(self.stream_names, self.weights, weights, temperature, anneal)
        self._index_sources: dict[int, ShardSource] = {}
        check_readings(self)
        self.repeats: list[float] = []
        self.bind_batch(StepSchedule.build("batch_size", 1))
        self.balance_target = balanced_target(self)  # packing="balance": the row cost aimed at

    def bind_batch(self, batch_sizes: StepSchedule) -> None:
        """Plan with ``batch_sizes`` rows per rank and step (a loader's, by step): the readings
        of ``upsample=True`` streams depend on the steps a pass holds (``readings.py``)."""
        repeats = resolve_repeats(self, JobTokens(batch_sizes, self.seq_lens, self.world_size))
        if repeats != self.repeats:
            self.repeats = repeats
            self.read_manifests = [reading_manifest(m, r) for m, r in zip(self.manifests, repeats)]
            self.planner = Planner(self.stream_names, self.read_manifests, seed=self.config.seed,
                                   sources=self._index_source, repeats=repeats)
            self._index_sources = {}

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
        source = ShardSource(self.read_manifests[stream], fetcher, config=self.storage,
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

    def start_first_reads(self, pass_idx: int) -> None:
        """Start reading, in the background, what global worker 0's first batch of pass
        ``pass_idx`` reads first: the record index and the first bytes of each stream's first
        shard in the pass's order, the head sized for the pass's first shuffle window
        (``EarlyReads.start``), through the sources the planner
        reads indexes with (``source/early.py``), so that the pipeline opened in this process
        after the plan takes them (``open_source``) instead of asking for them once the plan
        is done. That worker starts at record 0 of the pass's first shard with records,
        whatever the number of workers: the reads go out beside the plan's own index reads
        (the shards other workers' cuts fall in). Streams read as several readings
        (``upsample``) or cut at token positions are left to their pipelines.
        ``close_head_start`` waits for the reads."""
        if self.config.cuts != "records" or self.evaluation:
            return
        window = window_size(self.config.shuffle_buffer, self.config.shuffle_warmup, 0)  # the first read
        for stream in range(len(self.streams)):
            if self.repeats[stream] != 1.0:
                continue
            layout = self.planner.layout(stream, pass_idx, 1)  # the shard order does not depend on the workers
            nonempty = np.flatnonzero(layout.rec > 0)
            if len(nonempty):
                self._index_source(stream).early.start(int(layout.order[nonempty[0]]), window)

    def close_head_start(self, pipeline: WorkerPipeline) -> None:
        """Close the pipeline that built an iteration's first batch in this process before its
        worker processes are forked (``StreamingLoader._head_start``): keep the record indexes
        it read, which the workers then read no more (``keep_indexes``), and wait for the reads
        ``start_first_reads`` started, so that no thread of either is left running."""
        sources = list(pipeline.sources)  # an evaluation pipeline drops its own at close
        pipeline.close()
        for i, source in enumerate(sources):
            if source is not None:  # an evaluation pipeline opens a stream's source once it reads it
                self._index_source(i).adopt_indexes(source)
        for source in self._index_sources.values():
            source.early.settle()

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
        fractions: Sequence[float] | None = None, share: bool = False,
    ) -> PassPlan | EvalPlan:
        """The plan of ``pass_idx`` for this job's topology (see ``plan.PassPlan``); with
        ``fractions``, of what is left of it (``Planner.pass_plan``). An evaluation dataset
        has one pass, the same every time (``evaluation.EvalPlan``). With ``share`` and a
        process group, the ranks compute it together, each reading only its own cuts' record
        indexes (``planning/shared.py``): every rank must then ask at the same point."""
        if self.config.cuts == "tokens" and not self.evaluation:
            self.planner.set_token_cuts(cut_spec(self, workers_per_rank, batch_size), self.eos_appended)
        if self.evaluation:
            return build_eval_plan(
                self.planner, eos_appended=self.eos_appended, world_size=self.world_size,
                workers_per_rank=workers_per_rank, batch_size=batch_size, seq_len=self.config.seq_len,
                packing=self.config.packing, eval_tokens=self.eval_tokens,
            )
        return self.planner.pass_plan(
            pass_idx, world_size=self.world_size, workers_per_rank=workers_per_rank,
            batch_size=batch_size, seq_len=self.seq_lens, packing=self.config.packing,
            eos_appended=self.eos_appended, first_step=first_step, fractions=fractions,
            share=self.topology if share and self.topology.can_gather else None,
        )

    def _load_manifests(self, share: bool) -> list[Manifest]:
        """Each stream's manifest, read once per job: with torch.distributed initialized (and
        ``share``), rank 0 reads them and broadcasts them, so every rank must build the
        dataset; an error on rank 0 is raised on every rank."""

        def load() -> list[Manifest]:
            with collector.paused():  # a manifest of many shards is many small objects
                return [Manifest.load(s.url, s.storage_options, retry=self.storage.retry, client=self.storage.client)
                        for s in self.streams]

        return Topology.from_rank_zero(load) if share else load()

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
    def rank(self) -> int:
        """This process's data-parallel rank (``topology.rank``)."""
        return self.topology.rank

    @property
    def world_size(self) -> int:
        """The number of data-parallel ranks (``topology.world_size``)."""
        return self.topology.world_size

    @property
    def stream_names(self) -> list[str]:
        return [s.name for s in self.streams]

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.streams]

    def describe(self) -> dict[str, Any]:
        """Everything the batch sequence depends on, apart from the loader's batch size and
        workers (plain data; the basis of resume fingerprints). A seq_len schedule is
        described as its ``[[step, seq_len], ...]``; an int as ever."""
        out = {
            "streams": [
                {"name": s.name, "weight": s.weight, "manifest": m.fingerprint, **describe_readings(s, m, r)}
                for s, m, r in zip(self.streams, self.manifests, self.repeats)
            ],
            "mixture": self.schedule.describe(),
            "world_size": self.world_size,
            # shuffle_warmup=0 is left out: states saved before it existed had full windows
            **saved_config(asdict(self.config)),
            **({"evaluation": True, "eval_tokens": self.eval_tokens} if self.evaluation else {}),
        }
        out["seq_len"] = self.seq_lens.describe()
        return out

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
        """The calling worker's blocks, with ``state_dict``/``load_state_dict`` (blocks.py).
        The topology is checked first (``Topology.checked``: a dataset built before the
        process group is bound to it here), and a framework that would shard the dataset
        again is refused (``foreign.py``)."""
        self.topology = self.topology.checked()
        refuse_foreign_sharding(self)
        if self.seq_lens.constant is None:
            raise ConfigError("a dataset with a seq_len schedule runs on the job clock: iterate it through "
                              "StreamingLoader, not directly")
        return BlockIterator(self)


class EvaluationDataset(PackedTokenDataset):
    """Every held-out token once per pass, in the same rows on any number of ranks, workers
    or batch size; no shuffle, no weights (docs/eval.md). A ``StreamingLoader`` over it
    replays the same pass from the top at every iteration and has no state to save.

    Args:
        streams: the held-out streams (URLs or ``Stream``s; weights are ignored).
        seq_len: tokens per row.
        eval_tokens: keep the first that many tokens (whole rows); default: all.
        packing: ``"concat"`` or ``"pad"``.
        eos_id, pad_id, provenance, boundary, rank, world_size, storage, manifests,
            share_manifests: as ``PackedTokenDataset``'s.
    """

    def __init__(
        self,
        streams: Stream | str | Sequence[Stream | str],
        *,
        seq_len: int,
        eval_tokens: int | None = None,
        packing: str = "concat",
        eos_id: int | None = None,
        pad_id: int = 0,
        provenance: bool = False,
        boundary: str = "document",
        rank: int | None = None,
        world_size: int | None = None,
        storage: StorageConfig | None = None,
        manifests: Sequence[Manifest] | None = None,
        share_manifests: bool = True,
    ) -> None:
        super().__init__(
            streams, seq_len=seq_len, packing=packing, eos_id=eos_id, pad_id=pad_id, provenance=provenance,
            boundary=boundary, rank=rank, world_size=world_size, storage=storage, manifests=manifests,
            share_manifests=share_manifests, evaluation=True, eval_tokens=eval_tokens,
        )
