"""Elastic resume: the rest of a pass, re-planned over another topology, every token once.

A global state (``state.py``) holds every saved worker's cursors. From them, with record
indexes only (no tokens), ``work_left`` lists what the saved job had not handed out in the
current pass, per stream:

* ``ranges``: records no worker had read yet (the tails of the workers' ranges);
* ``windows``: the rest of each worker's current shuffle window, compactly: the window's
  record ranges, its shuffle key, how many of its documents were handed out (``pos``) and
  how far into the next one (``offset``, in concat packing the packer's carry), with the
  tokens and documents it still holds. One entry per saved worker, whatever the window size.

Documents in shuffle windows and the packer's carry are thus part of the work, not lost.
``assign_work`` deals it to the new topology deterministically: the ranges, sorted, are cut
at exact token quantiles (per-record lengths from the shard indexes), then each window's rest
goes to the worker with the fewest tokens so far. Each new worker emits its windows' rests
first (``ShuffleBuffer`` windows -k..-1, laid out as a restore lays out a window), then reads
its ranges through a fresh window shuffle. ``remaining_plan`` makes a ``PassPlan`` of it, so
the steps left are equal on every rank. Chained restarts work the same way: the plan of a resumed pass
is itself built from the saved work, so its workers' cursors are read against it.

The result is JSON-able and goes into the loader's state (``remaining``), so an exact resume
of a resumed job rebuilds the same plan.
"""

from __future__ import annotations

import heapq
from typing import Any, Sequence

import numpy as np

from ..errors import ResumeMismatchError
from ..pipeline.dataset import WorkerPipeline
from ..planning.plan import PassPlan, Range, plan_shape, steps_for, worker_rows
from ..planning.steps import StepSchedule
from ..planning.planner import worker_work
from ..planning.readings import count as reading_count
from ..stages.balance import window_rests
from ..stages.interleave import Interleaver
from .cut_replan import assign_token_work
from .cut_work import pass_unassigned, rest_unassigned, split_cut_records, use_saved_cuts
from .probes import buffer_work_left
from .state import order_config, saved_workers

# {"pass": p, "streams": [{"ranges": [[s, a, b], ...],
#                          "windows": [{"ranges", "key", "pos", "offset", "tokens", "docs"}, ...]}, ...]}
Work = dict[str, Any]


def work_left(dataset, state: dict[str, Any]) -> Work:
    """What the saved job had not handed out in its current pass (see the module docstring)."""
    saved_g = int(state["world_size"]) * int(state["workers_per_rank"])
    pass_idx = int(state["pass"])
    use_saved_cuts(dataset, state)  # token cuts: the saved topology's
    previous = (state.get("remaining") or {}).get("work")
    assigned = assign_work(dataset, previous, saved_g) if previous else None
    streams = [{"ranges": [], "windows": []} for _ in dataset.streams]
    for g, worker_state in saved_workers(state):  # every rank's part: elastic_blockers refuses a missing one
        buffers = _probe_buffers(dataset, pass_idx, saved_g, g, assigned, int(state["generation"]))
        if worker_state is None:  # nothing handed out: all of its work is left
            for i, buffer in enumerate(buffers):
                ranges, units = split_cut_records(buffer.source.ranges_for(pass_idx), buffer.source.source,
                                                  dataset.eos_appended[i])
                streams[i]["ranges"] += ranges
                streams[i]["windows"] += [dict(u) for u in buffer.windows_for(pass_idx)] + units
            continue

        stream_states, rests = WorkerPipeline.stream_states(worker_state), [[]] * len(streams)
        if dataset.config.packing == "balance":  # the rest of an open balanced window (stages/balance.py)
            end, rests = window_rests(worker_state["packer"], dataset.config.seq_len, dataset.balance_target,
                                      len(streams))
            stream_states = Interleaver.source_states(end)
        for i, (buffer, stream_state) in enumerate(zip(buffers, stream_states)):
            p, ranges, units = buffer_work_left(buffer, stream_state)
            if p != pass_idx:  # a finite reader never leaves its pass
                continue
            ranges, pieces = split_cut_records(ranges, buffer.source.source, dataset.eos_appended[i])
            streams[i]["ranges"] += ranges
            streams[i]["windows"] += units + pieces + rests[i]
    for s in streams:
        s["ranges"] = _merge(sorted(s["ranges"]))
        s["windows"] = sorted(s["windows"], key=lambda u: (u["ranges"], u["key"]))
    out = {"pass": pass_idx, "streams": streams}
    if previous:  # a resumed pass: what its own re-plan gave no worker
        unassigned = rest_unassigned(dataset, previous, assigned, work_tokens(dataset, previous))
    else:
        unassigned = pass_unassigned(dataset, state)
    if unassigned is not None:  # token cuts: what the saved pass's plan gave no worker
        out["unassigned"] = unassigned
    return out


def _merge(ranges: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for s, a, b in ranges:
        if out and out[-1][0] == s and out[-1][2] == a:
            out[-1][2] = b
        elif b > a:
            out.append([s, a, b])
    return out


def _probe_buffers(dataset, pass_idx: int, num_global: int, g: int, assigned, generation: int) -> list:
    """Shuffle buffers configured as saved global worker ``g`` had them (reading record
    indexes through the dataset's shared index sources, never tokens)."""
    from ..stages.read import ShardReader
    from ..stages.shuffle import ShuffleBuffer

    cfg = dataset.config
    out = []
    for i, stream in enumerate(dataset.streams):
        ranges_for, windows_for = worker_work(dataset.planner, i, num_global, g, pass_idx, assigned)
        reader = ShardReader(dataset._index_source(i), ranges_for=ranges_for, stream_key=stream.name,
                             infinite=False, first_pass=pass_idx)
        out.append(ShuffleBuffer(reader, size=cfg.shuffle_buffer, seed=cfg.seed, stream_key=stream.name,
                                 global_worker=g, eos_id=cfg.eos_id if dataset.eos_appended[i] else None,
                                 windows_for=windows_for, generation=generation, warmup=cfg.shuffle_warmup))
    return out


def assign_work(dataset, work: Work, num_global: int) -> list[tuple[list, list, np.ndarray, np.ndarray]]:
    """Per stream, (ranges, saved windows' rests, tokens, documents) per global worker: the
    ranges cut at exact token quantiles, then each window's rest to the worker with the fewest
    tokens so far (largest first; deterministic)."""
    check_work(dataset, work)
    by_tokens = getattr(dataset.config, "cuts", "records") == "tokens"
    spec = dataset.planner.cut_specs.get(num_global) if by_tokens else None
    if spec is not None:  # token cuts: the rest of the pass cut at token positions too
        return assign_token_work(dataset, work, spec)
    out = []
    for i, stream_work in enumerate(work["streams"]):
        eos = dataset.eos_appended[i]
        ranges = [tuple(r) for r in stream_work["ranges"]]
        # the indexes of every shard the split and the counts need, read in parallel
        dataset.planner.prefetch_indexes(i, {r[0] for r in ranges})
        parts, tokens, docs = _split(dataset.planner, i, ranges, num_global, eos)
        windows: list[list[dict]] = [[] for _ in range(num_global)]
        heap = [(int(t), g) for g, t in enumerate(tokens)]
        heapq.heapify(heap)
        # (the work lists them sorted: a stable sort by tokens keeps that order among equals)
        for unit in sorted(stream_work.get("windows", []), key=lambda u: -int(u["tokens"])):
            load, g = heapq.heappop(heap)
            windows[g].append(unit)
            tokens[g] += int(unit["tokens"])
            docs[g] += int(unit["docs"])
            heapq.heappush(heap, (load + int(unit["tokens"]), g))
        out.append((parts, windows, tokens, docs))
    return out


def check_work(dataset, work: Work) -> None:
    """Saved work (from a state file: never trusted) points into the streams' records, each
    range in a reading the stream has (``planning/readings.py``), else ``ResumeMismatchError``."""
    planner = dataset.planner
    streams = work.get("streams") if isinstance(work, dict) else None
    if not isinstance(streams, list) or len(streams) != len(planner.names):
        raise ResumeMismatchError(f"loader state: remaining work must list {len(planner.names)} streams")
    for i, stream_work in enumerate(streams):
        name, repeat = planner.names[i], planner.repeats[i]
        columns = planner.manifests[i].columns["num_records"]
        shards = len(columns) // reading_count(repeat)
        units = [("ranges", stream_work.get("ranges", []))]
        units += [("a saved window", u.get("ranges", [])) for u in stream_work.get("windows", [])]
        for what, ranges in units:
            for r in ranges:
                try:
                    shard, a, b = (int(x) for x in r)
                except (TypeError, ValueError):
                    raise ResumeMismatchError(f"loader state: stream {name!r}: {what} holds {r!r}, not "
                                              "(shard, start, stop)") from None
                if not 0 <= shard < len(columns):
                    raise ResumeMismatchError(
                        f"loader state: stream {name!r}: {what} reads reading {shard // max(1, shards)} of shard "
                        f"{shard % max(1, shards)}, outside its {len(columns) // max(1, shards)} reading(s) of "
                        f"{shards} shard(s) per pass (repeat={repeat:g})")
                if not 0 <= a <= b <= int(columns[shard]):
                    raise ResumeMismatchError(f"loader state: stream {name!r}: {what} reads records {a}..{b} of "
                                              f"shard {shard}, which has {int(columns[shard])}")


def _split(planner, stream: int, ranges: list[Range], n: int, eos: bool):
    """``ranges`` (in order) cut into ``n`` consecutive parts of near-equal tokens, each cut at
    the record boundary nearest its quantile (exact record lengths); with each part's tokens
    and non-empty documents."""
    if not ranges:
        return [[] for _ in range(n)], np.zeros(n, np.int64), np.zeros(n, np.int64)
    lengths, nonempty = [], []
    for shard, a, b in ranges:
        tokens, docs = planner._prefix_of(stream, shard)
        d = np.diff(docs[a : b + 1])
        lengths.append(np.diff(tokens[a : b + 1]) + (d if eos else 0))
        nonempty.append(d)
    cum = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
    dcum = np.concatenate([[0], np.cumsum(np.concatenate(nonempty))])
    targets = cum[-1] * np.arange(1, n) / n
    upper = np.minimum(np.searchsorted(cum, targets, side="left"), len(cum) - 1)
    lower = np.maximum(upper - 1, 0)
    nearer_lower = (upper > 0) & (cum[upper] - targets > targets - cum[lower])
    cuts = np.maximum.accumulate(np.where(nearer_lower, lower, upper)) if n > 1 else np.zeros(0, np.int64)
    bounds = np.concatenate([[0], cuts, [len(cum) - 1]]).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum([b - a for _, a, b in ranges])])
    parts = []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        piece: list[Range] = []
        j = int(np.searchsorted(starts, lo, side="right")) - 1
        while lo < hi:
            shard, a, b = ranges[j]
            take = min(hi, int(starts[j + 1])) - lo
            first = a + lo - int(starts[j])
            piece.append((shard, first, first + take))
            lo += take
            j += 1
        parts.append(piece)
    return parts, np.diff(cum[bounds]).astype(np.int64), np.diff(dcum[bounds]).astype(np.int64)


def remaining_plan(dataset, work: Work, *, world_size: int, workers_per_rank: int, batch_size: int | StepSchedule,
                   first_step: int) -> PassPlan:
    """The plan of the rest of pass ``work["pass"]`` on this topology (steps equal on every
    rank: every rank computes it from the same saved state)."""
    n = world_size * workers_per_rank
    assigned = assign_work(dataset, work, n)
    cfg = dataset.config
    tokens = sum(a[2] for a in assigned).tolist()
    docs = sum(a[3] for a in assigned).tolist()
    batch = StepSchedule.build("batch_size", batch_size)
    # a dataset-like stand-in without schedules (tools/bench_plan_scale.py) has one seq_len
    seq = getattr(dataset, "seq_lens", None) or StepSchedule.build("seq_len", cfg.seq_len)
    rows = [worker_rows(t, d, seq_len=seq, packing=cfg.packing) for t, d in zip(tokens, docs)]
    steps = steps_for(rows, world_size=world_size, workers_per_rank=workers_per_rank, batch_size=batch,
                      seq_len=seq, packing=cfg.packing, first_step=first_step)
    last_step = getattr(assigned, "last_step", None)  # token cuts: the rest ends in a padded step
    steps = assigned.steps if last_step else steps
    return PassPlan(
        pass_idx=int(work["pass"]), world_size=world_size, workers_per_rank=workers_per_rank,
        packing=cfg.packing, streams=list(dataset.stream_names), ranges=[a[0] for a in assigned], tokens=tokens,
        rows=rows, steps=steps, first_step=first_step, windows=[a[1] for a in assigned],
        unassigned=rest_unassigned(dataset, work, assigned, work_tokens(dataset, work)), last_step=last_step,
        **plan_shape(batch, seq, first_step),
    )


def work_tokens(dataset, work: Work) -> list[int]:
    """Tokens left per stream in ``work``."""
    out = []
    for i, stream_work in enumerate(work["streams"]):
        eos = dataset.eos_appended[i]
        total = 0
        for shard, a, b in stream_work["ranges"]:
            t, d = dataset.planner.counts(i, shard, a, b)
            total += t + (d if eos else 0)
        total += sum(int(u["tokens"]) for u in stream_work.get("windows", []))
        out.append(total)
    return out


def elastic_blockers(dataset, state: dict[str, Any], differences: Sequence[str]) -> list[str]:
    """Why the saved state cannot resume elastically here (empty: it can)."""
    why = []
    changeable = {"world_size", "workers_per_rank", "batch_size"}
    saved, now = order_config(state["config"]), dataset.describe()
    for key in sorted(set(saved) | set(now)):
        if key in changeable:
            continue
        if saved.get(key) != now.get(key):
            why.append(f"{key} changed")
    if dataset.config.infinite:
        why.append("infinite=True (elastic resume re-plans the rest of a finite pass)")
    if dataset.config.packing == "bestfit":
        why.append("packing='bestfit' (its packing window is not part of the saved work)")
    missing = [r for r, p in enumerate(state["ranks"]) if p is None]
    if missing:
        why.append(f"the state lacks the parts of rank(s) {missing}")
    remaining = state.get("remaining") or {}
    if remaining and "work" not in remaining:
        why.append("the saved pass was itself resumed statistically")
    return why
