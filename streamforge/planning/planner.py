"""The planner: a dataset's plans of passes, with the I/O that exact counts need.

``plan.py`` is pure arithmetic; this module feeds it. Ranges are a function of the manifests
(no I/O, cached per pass). The step count of a pass needs each global worker's exact tokens
and documents: whole shards take them from the manifest, and a shard cut between workers
(at most one per cut) takes them from its record index, one small ranged read, fetched in
parallel and cached. Streams written before the manifest had a ``num_docs`` column have
their whole shards' indexes read too (their empty records get no EOS, and pad packing
builds one row per non-empty document).

Every rank computes the same plan from the same bytes, with no communication.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from ..errors import ShardCorruptError
from ..format.manifest import Manifest
from .layout import Layout
from .plan import PassPlan, Range, build_pass_plan, records_at, trim_ranges
from .readings import count as reading_count, plan_readings, reading_cut_shards
from .shared import shared_counts
from .shared_cuts import share_token_cuts
from .cut_planner import TokenCutPlanning
from .token_cuts import CutSpec, cut_ranges

_FETCH_THREADS = 16
_RANGE_CACHE = 8  # passes (x topologies) whose ranges are kept


class Planner(TokenCutPlanning):
    """``manifests``: the streams' reading manifests (``readings.reading_manifest``) and
    ``repeats`` the readings of each per pass (default: 1 each)."""

    def __init__(self, names: Sequence[str], manifests: Sequence[Manifest], *, seed: int, sources=None,
                 repeats: Sequence[float] | None = None) -> None:
        self.names = list(names)
        self.manifests = list(manifests)
        self.repeats = [1.0] * len(self.names) if repeats is None else [float(r) for r in repeats]
        self.seed = int(seed)
        self._sources = sources  # callable: stream index -> ShardSource, for index reads
        # token cuts (``token_cuts.py``): what they are made for, and which streams get an EOS
        self.cut_spec: CutSpec | None = None  # the last one set
        self.cut_specs: dict[int, CutSpec] = {}  # by number of global workers
        self.cut_eos: list[bool] = [False] * len(self.names)
        self._reset()

    def _reset(self) -> None:
        self._ranges: dict[tuple[int, int, int], list[list[Range]]] = {}
        self._worker_ranges: dict[tuple[int, int, int, int], list[Range]] = {}
        self._prefix: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._column_lists: dict[int, tuple] = {}
        self._laid: dict[tuple[int, int], tuple[int, int]] = {}  # (stream, shard): (block, offset)
        self._blocks: dict[int, np.ndarray] = {}  # running sums over the indexes read together
        self._cut: dict = {}  # token cuts: budgets, shard tokens, and each cut plan's tokens

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_ranges", None)
        state.pop("_worker_ranges", None)
        state.pop("_prefix", None)
        state.pop("_column_lists", None)
        state.pop("_laid", None)
        state.pop("_blocks", None)
        state.pop("_cut", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    # -- ranges (pure) -----------------------------------------------------------------------
    def ranges(self, stream: int, pass_idx: int, num_global_workers: int) -> list[list[Range]]:
        """Every global worker's ranges of ``stream`` in ``pass_idx`` (cut exactly: the
        record index of every shard a cut falls in is read, in parallel, and kept)."""
        key = (stream, pass_idx, num_global_workers)
        cached = self._ranges.get(key)
        if cached is None:
            cached = self._plan(stream, pass_idx, num_global_workers, None)
            if len(self._ranges) >= _RANGE_CACHE * len(self.names):
                self._ranges.pop(next(iter(self._ranges)))
            self._ranges[key] = cached
        return cached

    def keep_ranges(self, stream: int, pass_idx: int, n: int, ranges: list[list[Range]]) -> None:
        """Keep every global worker's ``ranges`` of a stream and pass, computed elsewhere
        (``shared.shared_counts``), as ``ranges`` would have."""
        if len(self._ranges) >= _RANGE_CACHE * len(self.names):
            self._ranges.pop(next(iter(self._ranges)))
        self._ranges[(stream, pass_idx, n)] = ranges

    def worker_ranges(self, stream: int, pass_idx: int, num_global_workers: int, global_worker: int) -> list[Range]:
        """One global worker's ranges: from the whole plan when it is at hand, else from that
        worker's two cuts alone (at most two record indexes read: what a worker process does)."""
        whole = self._ranges.get((stream, pass_idx, num_global_workers))
        if whole is not None:
            return whole[global_worker]
        key = (stream, pass_idx, num_global_workers, global_worker)
        cached = self._worker_ranges.get(key)
        if cached is None:
            cached = self._plan(stream, pass_idx, num_global_workers, [global_worker])[0]
            if len(self._worker_ranges) >= _RANGE_CACHE * len(self.names) * 64:
                self._worker_ranges.pop(next(iter(self._worker_ranges)))
            self._worker_ranges[key] = cached
        return cached

    def _plan(self, stream: int, pass_idx: int, n: int, workers: list[int] | None) -> list[list[Range]]:
        if self._token_cut(n):
            return self._plan_tokens(stream, pass_idx, n, workers)
        if self.repeats[stream] != 1.0:
            return self._plan_readings(stream, pass_idx, n, workers)
        layout = self.layout(stream, pass_idx, n)
        if self._sources is None:
            return layout.ranges(workers)
        ks = range(1, n) if workers is None else {k for g in workers for k in (g, g + 1)}
        self.prefetch_indexes(stream, layout.cut_shards(ks))
        return layout.ranges(workers, self.record_ends(stream))

    def _plan_readings(self, stream: int, pass_idx: int, n: int, workers: list[int] | None) -> list[list[Range]]:
        """``_plan`` of a repeated stream: its reading manifest's first ``S`` shards are the
        stream's own (``readings.py``)."""
        args = dict(seed=self.seed, stream_key=self.names[stream], pass_idx=pass_idx, num_global_workers=n)
        repeat = self.repeats[stream]
        num_shards = len(self.manifests[stream].shard_names) // reading_count(repeat)
        c = self.manifests[stream].columns
        records, tokens = c["num_records"][:num_shards], c["num_tokens"][:num_shards]
        record_tokens = None
        if self._sources is not None:
            self.prefetch_indexes(stream, reading_cut_shards(records, tokens, repeat=repeat, workers=workers, **args))
            record_tokens = lambda shard: np.diff(self._prefix_of(stream, shard)[0])  # noqa: E731
        return plan_readings(records, tokens, repeat=repeat, record_tokens=record_tokens, workers=workers, **args)

    def layout(self, stream: int, pass_idx: int, n: int) -> Layout:
        """Stream ``stream``'s shards in ``pass_idx``'s order, to be cut for ``n`` global workers."""
        m = self.manifests[stream]
        return Layout(m.columns["num_records"], m.columns["num_tokens"], self.seed, self.names[stream], pass_idx, n)

    def record_ends(self, stream: int) -> "_Ends":
        """The ``RecordEnds`` of a stream's shards (their indexes read where not yet read)."""
        return _Ends(self, stream)

    # -- the plan of a pass ------------------------------------------------------------------
    def pass_plan(
        self,
        pass_idx: int,
        *,
        world_size: int,
        workers_per_rank: int,
        batch_size: int,
        seq_len: int,
        packing: str,
        eos_appended: Sequence[bool],
        first_step: int = 0,
        fractions: Sequence[float] | None = None,
        share: Any = None,
    ) -> PassPlan:
        """With ``fractions`` (one per stream), the plan of what is left of the pass when
        every worker has read that fraction of each stream's ranges (statistical resume).

        With ``share`` (the job's ``Topology``, whose ``gather`` reaches every rank; every
        rank must then call this at the same point), the ranks compute the plan together:
        each cuts and counts its own workers' ranges, reading only the record indexes of the
        shards its own cuts fall in, and one all-gather hands every rank the others' cuts and
        counts (``shared.shared_counts``). The plan is the same either way; without, every
        rank reads the index of every shard any cut falls in (up to one a global worker)."""
        n = world_size * workers_per_rank
        if self._token_cut(n):
            if share is not None and share.world_size == world_size > 1 and fractions is None:
                share_token_cuts(self, share, pass_idx, n)
            return self._token_pass_plan(pass_idx, n, fractions, dict(
                pass_idx=pass_idx, world_size=world_size, workers_per_rank=workers_per_rank, batch_size=batch_size,
                seq_len=seq_len, packing=packing, first_step=first_step))
        # a repeated stream's readings are cut reading by reading (``readings.py``), which the
        # shared cuts do not know: such a plan is computed by every rank alone
        if share is not None and share.world_size == world_size > 1 and all(r == 1.0 for r in self.repeats):
            per_stream, totals = shared_counts(self, share, pass_idx, n, fractions)
        else:
            per_stream = [self.ranges(s, pass_idx, n) for s in range(len(self.names))]
            if fractions is not None:
                per_stream = [
                    [trim_ranges(r, records_at(r, f)) for r in workers] for workers, f in zip(per_stream, fractions)
                ]
            self._prefetch_counts(per_stream)
            totals = self.totals
        return build_pass_plan(
            per_stream, totals, streams=self.names, eos_appended=eos_appended,
            pass_idx=pass_idx, world_size=world_size, workers_per_rank=workers_per_rank,
            batch_size=batch_size, seq_len=seq_len, packing=packing, first_step=first_step,
        )

    def counts(self, stream: int, shard: int, start: int, stop: int) -> tuple[int, int]:
        """(tokens, non-empty documents) of records ``start..stop-1`` of a shard, exactly."""
        return self.totals(stream, ((shard, start, stop),))

    def totals(self, stream: int, ranges) -> tuple[int, int]:
        """(tokens, non-empty documents) of ``ranges`` of a stream, summed: a whole shard's
        from the manifest, a part's from its record index (``_prefix_of``)."""
        records, shard_tokens, shard_docs = self._columns(stream)
        tokens = docs = 0
        for shard, start, stop in ranges:
            if shard_docs is not None and start == 0 and stop == records[shard]:
                tokens += shard_tokens[shard]
                docs += shard_docs[shard]
            else:
                prefix_tokens, prefix_docs = self._prefix_of(stream, shard)
                tokens += int(prefix_tokens[stop] - prefix_tokens[start])
                docs += int(prefix_docs[stop] - prefix_docs[start])
        return tokens, docs

    def _columns(self, stream: int) -> tuple[list[int], list[int], list[int] | None]:
        """A stream's records, tokens and documents (None where the manifest has no counts)
        per shard, as lists: a plan asks for them once a range, 100,000 times for a stream of
        100,000 shards, where reading a numpy column costs more than the sum."""
        got = self._column_lists.get(stream)
        if got is None:
            c = self.manifests[stream].columns
            got = self._column_lists[stream] = (
                c["num_records"].tolist(), c["num_tokens"].tolist(),
                c["num_docs"].tolist() if "num_docs" in c else None,
            )
        return got

    def _prefetch_counts(self, per_stream: list[list[list[Range]]]) -> None:
        """Read, in parallel, the record indexes the counts of this plan need."""
        wanted = set()
        for s, workers in enumerate(per_stream):
            records, _, docs = self._columns(s)
            for ranges in workers:
                for shard, a, b in ranges:  # a part of a shard, or a manifest without counts
                    if (docs is None or a != 0 or b != records[shard]) and (s, shard) not in self._prefix:
                        wanted.add((s, shard))
        self._read_prefixes(sorted(wanted))

    def prefetch_counts(self, stream: int, ranges: Sequence[Range]) -> None:
        """Read, in parallel, the record indexes ``counts`` needs for ``ranges`` of a stream."""
        per_stream: list[list[list[Range]]] = [[] for _ in self.names]
        per_stream[stream] = [list(ranges)]
        self._prefetch_counts(per_stream)

    def record_lengths(self, stream: int, shards: Sequence[int], *, eos: bool) -> list[np.ndarray]:
        """Token count of every record of each of ``shards`` (plus one per non-empty record
        with ``eos``), their indexes read in parallel."""
        self.prefetch_indexes(stream, shards)
        out = []
        for k in shards:
            tokens, docs = self._prefix[(stream, k)]
            lengths = np.diff(tokens)
            out.append(lengths + np.diff(docs) if eos else lengths)
        return out

    def prefetch_indexes(self, stream: int, shards) -> None:
        """Read, in parallel, the record indexes of ``shards`` of a stream not read yet."""
        self._read_prefixes(sorted({(stream, int(k)) for k in shards if (stream, int(k)) not in self._prefix}))

    def _read_prefixes(self, wanted: list[tuple[int, int]]) -> None:
        """Read the (stream, shard) indexes in ``wanted`` on up to ``_FETCH_THREADS`` threads,
        each taking a run of them (one task per thread, not per index); the threads only read
        (the I/O), and the running sums of every index read are taken here, at once."""
        if not wanted:
            return
        threads = min(_FETCH_THREADS, len(wanted))
        if threads == 1:
            self._prefix.update(zip(wanted, _prefixes([self._read_lengths(*k) for k in wanted])))
            return
        runs = [wanted[t::threads] for t in range(threads)]
        with ThreadPoolExecutor(threads) as pool:
            got = list(pool.map(lambda run: [self._read_lengths(*k) for k in run], runs))
        by_key = dict(zip([k for run in runs for k in run], [x for part in got for x in part]))
        lengths = [by_key[k] for k in wanted]
        self._prefix.update(zip(wanted, _prefixes(lengths)))
        block = self._prefix[wanted[0]][0].base  # the running sum the prefixes are views of
        if block is not None:
            self._blocks[id(block)] = block
            offsets = np.cumsum([0] + [len(x) for x in lengths[:-1]]).tolist()
            self._laid.update((k, (id(block), o)) for k, o in zip(wanted, offsets))

    def _prefix_of(self, stream: int, shard: int) -> tuple[np.ndarray, np.ndarray]:
        key = (stream, shard)
        if key not in self._prefix:
            self._prefix[key] = _prefixes([self._read_lengths(stream, shard)])[0]
        return self._prefix[key]

    def _read_lengths(self, stream: int, shard: int) -> np.ndarray:
        """The token count of each of a shard's records, from its record index (zeros for a
        damaged index under ``on_error="skip"``)."""
        if self._sources is None:
            raise RuntimeError("this planner has no shard sources to read record indexes from")
        source = self._sources(stream)
        try:
            return source.index(shard).records["num_tokens"]
        except ShardCorruptError:
            if source.config.on_error != "skip":
                raise
            return np.zeros(int(self.manifests[stream].columns["num_records"][shard]), np.int64)


class _Ends:
    """A stream's ``RecordEnds`` (``layout.py``) from the planner's record indexes; ``bank``
    answers without copying when the shards' indexes were read together, in one running sum."""

    def __init__(self, planner: Planner, stream: int) -> None:
        self.planner, self.stream = planner, stream

    def __call__(self, shards) -> list[np.ndarray]:
        return [self.planner._prefix_of(self.stream, k)[0] for k in shards]

    def bank(self, shards):
        laid = [self.planner._laid.get((self.stream, k)) for k in shards]
        if not laid or any(x is None or x[0] != laid[0][0] for x in laid):
            return None
        block = self.planner._blocks[laid[0][0]]
        offset = np.array([o for _, o in laid], np.int64)
        count = np.array([len(self.planner._prefix[(self.stream, k)][0]) - 1 for k in shards], np.int64)
        return block, offset + 1, count, block[offset]


def _prefixes(lengths: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, non-empty documents) running sums of each shard's record lengths: one value
    before its first record and one after each. They are views of one running sum over all of
    the shards, so they need not start at 0: only their differences are meant."""
    flat = np.concatenate([np.asarray(x).ravel() for x in lengths]).astype(np.int64) if lengths else np.zeros(0, np.int64)
    tokens = np.concatenate([[0], np.cumsum(flat)])
    docs = np.concatenate([[0], np.cumsum(flat > 0)])
    bounds = np.cumsum([0] + [len(x) for x in lengths]).tolist()
    return [(tokens[a:b + 1], docs[a:b + 1]) for a, b in zip(bounds[:-1], bounds[1:])]


def format_plan(
    urls: Sequence[str],
    *,
    world_size: int,
    workers: int,
    seed: int = 0,
    pass_idx: int = 0,
    storage_options: dict[str, Any] | None = None,
    names: Sequence[str] | None = None,
) -> str:
    """A human-readable plan, as the job would cut it: per (rank, worker), per stream, its
    ranges, records and exact tokens (record indexes of cut shards read in parallel)."""
    from ..source import ShardSource

    sources = [ShardSource.open(u, storage_options) for u in urls]
    keys = list(names) if names else [f"stream{i}" for i in range(len(urls))]
    planner = Planner(keys, [s.manifest for s in sources], seed=seed, sources=sources.__getitem__)
    n = world_size * workers
    plans = [planner.ranges(i, pass_idx, n) for i in range(len(keys))]
    for i, plan in enumerate(plans):
        planner.prefetch_counts(i, [r for ranges in plan for r in ranges])
    lines = [f"plan: seed={seed} pass={pass_idx} world_size={world_size} workers={workers} "
             f"({n} global workers)"]
    totals = []
    for g in range(n):
        rank, worker = divmod(g, workers)
        per_stream = []
        total = 0
        for i, (key, plan) in enumerate(zip(keys, plans)):
            ranges = plan[g]
            toks = sum(planner.counts(i, s, a, b)[0] for s, a, b in ranges)
            total += toks
            recs = sum(b - a for _, a, b in ranges)
            shown = " ".join(f"{s}[{a}:{b}]" for s, a, b in ranges[:6])
            more = f" +{len(ranges) - 6} more" if len(ranges) > 6 else ""
            per_stream.append(f"    {key}: {len(ranges)} ranges, {recs} records, {toks:,} tokens: {shown}{more}")
        totals.append(total)
        lines.append(f"rank {rank} worker {worker} (global {g}): {total:,} tokens")
        lines.extend(per_stream)
    mean = sum(totals) / len(totals) if totals else 0.0
    if mean:
        lines.append(f"balance: max/mean tokens = {max(totals) / mean:.4f}, min/mean = {min(totals) / mean:.4f}")
    return "\n".join(lines)


def worker_work(planner: "Planner", stream: int, num_global: int, g: int, pass_idx: int, assigned):
    """(ranges_for, windows_for) of global worker ``g``: its share of ``assigned`` work in
    ``pass_idx``, the plan's ranges (and no saved windows) in every other pass."""
    def ranges_for(p: int) -> list[Range]:
        if assigned is not None and p == pass_idx:
            got = assigned[stream][0][g]
            cut = getattr(got, "cut", None)  # token cuts: a piece of a document at either end
            return [tuple(r) for r in got] if cut is None else cut_ranges([tuple(r) for r in got], cut)
        return planner.worker_ranges(stream, p, num_global, g)

    def windows_for(p: int) -> list:
        if assigned is not None and p == pass_idx:
            return list(assigned[stream][1][g])
        return []

    return ranges_for, windows_for
