"""Elastic resume: the rest of a pass, re-planned over another topology, every token once.

A global state (``state.py``) holds every saved worker's cursors. From them, with record
indexes only (no tokens), ``work_left`` lists what the saved job had not handed out in the
current pass, per stream:

* ``ranges``: records no worker had read yet (the tails of the workers' ranges);
* ``windows``: the rest of each worker's current shuffle window, compactly: the window's
  record ranges, its shuffle key, how many of its documents were handed out (``pos``) and
  how far into the next one (``offset``, in concat packing the packer's carry), with the
  tokens and documents it still holds. One entry per saved worker (after an elastic resume,
  per piece of a rest it was dealt: see below), whatever the window size.

Documents in shuffle windows and the packer's carry are thus part of the work, not lost.
``assign_work`` deals it to the new topology deterministically, stream by stream. A stream's
work is one sequence: its windows' rests (sorted by window), each rest's documents in the
order it emits them (its window's order from its key, from ``pos`` on), then its ranges'
records, sorted. The sequence is cut into one consecutive part per new worker at the document
or record boundary nearest each quantile of its weight (a document's tokens with EOS; in pad
packing 1, its row; per-record lengths from the shard indexes), so the workers' rows differ by
about a document a stream, as a fresh plan's do (the cuts of a stream are moved by how far
those of the streams before it fell past their quantiles, so the roundings do not add up).

A rest a cut falls inside is split there into consecutive pieces, each a window's rest of its
own: the same ranges, key and trims, ``pos`` its first document in the window's order, ``stop``
where its order ends (``ShuffleBuffer`` lays a piece out as a restore lays out its window,
stopping there), ``offset`` only on the rest's first piece (in concat packing the packer's
carry is the rest of that first document). Only those rests are read from the indexes; the
others count as their saved tokens and documents. Rests dealt whole (to the worker with the
fewest tokens) and ranges cut by tokens alone, as before, left the re-plan's steps to the
lightest worker: a pad pass of two streams (80 documents, 40 steps) saved at step 32 on one
rank and finished on two got rows [15, 1], no step left, 16 documents (497 tokens) dropped;
in concat packing 1,885 of its 8,797 tokens; now none and 93 (less than a step).

Each new worker emits its windows' rests first (``ShuffleBuffer`` windows -k..-1, laid out as
a restore lays out a window), then reads its ranges through a fresh window shuffle.
``remaining_plan`` makes a ``PassPlan`` of it, so the steps left are equal on every rank. With
``cuts="tokens"`` the rest is cut at token positions instead, rests and documents included
(``cut_replan.py``). Chained restarts work the same way: the plan of a resumed pass is itself
built from the saved work, so its workers' cursors are read against it, and a piece's rest is
again a piece (``pos`` on, to its ``stop``).

The result is JSON-able and goes into the loader's state (``remaining``), so an exact resume
of a resumed job rebuilds the same plan.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

import numpy as np

from ..errors import ResumeMismatchError
from ..loader import collector
from ..pipeline.dataset import WorkerPipeline
from ..planning.plan import PassPlan, Range, plan_shape, steps_for, worker_rows
from ..planning.steps import StepSchedule
from ..planning.planner import worker_work
from ..planning.readings import count as reading_count
from ..stages.balance import window_rests
from ..stages.interleave import Interleaver
from .cut_replan import assign_token_work
from .cut_work import pass_unassigned, rest_unassigned, split_cut_records, use_saved_cuts
from .probes import buffer_work_left, rest_piece, units_doc_tokens
from .state import order_config, saved_workers

# how ``assign_work`` deals saved work, saved with it (``work["deal"]``): 2, window rests cut
# into pieces with the ranges; work without it was dealt by an older streamforge (rests whole),
# whose plan this one does not rebuild (the checkpointer resumes such a state statistically)
DEAL = 2

# {"pass": p, "deal": DEAL, "streams": [{"ranges": [[s, a, b], ...],
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
        s["windows"] = sorted(s["windows"], key=_unit_order)
    out = {"pass": pass_idx, "deal": DEAL, "streams": streams}
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
    stream's work (its windows' rests' documents in emission order, then its ranges) cut into
    ``num_global`` consecutive parts of near-equal rows (``_deal``; deterministic)."""
    check_work(dataset, work)
    by_tokens = getattr(dataset.config, "cuts", "records") == "tokens"
    spec = dataset.planner.cut_specs.get(num_global) if by_tokens else None
    if spec is not None:  # token cuts: the rest of the pass cut at token positions too
        return assign_token_work(dataset, work, spec)
    by_docs = dataset.config.packing == "pad"  # a row per document; else rows hold tokens
    out, ahead = [], np.zeros(max(num_global - 1, 0))
    for i, stream_work in enumerate(work["streams"]):
        ranges = [tuple(int(x) for x in r) for r in stream_work["ranges"]]
        # the indexes of every shard the split and the counts need, read in parallel
        dataset.planner.prefetch_indexes(i, {r[0] for r in ranges})
        units = sorted(stream_work.get("windows", []), key=_unit_order)
        part = _deal(dataset, i, ranges, units, num_global, dataset.eos_appended[i], by_docs, ahead)
        out.append(part[:4])
        ahead = ahead + part[4]
    return out


def _unit_order(unit: dict) -> tuple:
    """Windows' rests in the work's order: by window, pieces of one window in emission order."""
    return unit["ranges"], int(unit["key"]), int(unit["pos"])


def dealt_here(state: dict[str, Any]) -> bool:
    """Whether the elastic re-plan a state's pass runs on (if any) was dealt as this streamforge
    deals it (``DEAL``), so that the plan its workers' cursors are read against can be rebuilt."""
    rest = state.get("remaining")
    work = rest.get("work") if isinstance(rest, dict) else None
    return not isinstance(work, dict) or work.get("deal") == DEAL


def check_work(dataset, work: Work) -> None:
    """Saved work (from a state file: never trusted) points into the streams' records, each
    range in a reading the stream has (``planning/readings.py``), else ``ResumeMismatchError``."""
    planner = dataset.planner
    streams = work.get("streams") if isinstance(work, dict) else None
    if not isinstance(streams, list) or len(streams) != len(planner.names):
        raise ResumeMismatchError(f"loader state: remaining work must list {len(planner.names)} streams")
    if work.get("deal") != DEAL:
        raise ResumeMismatchError(f"loader state: remaining work dealt as {work.get('deal')!r}; this streamforge "
                                  f"deals saved work as {DEAL} (an older one's plan cannot be rebuilt)")
    for i, stream_work in enumerate(streams):
        name, repeat = planner.names[i], planner.repeats[i]
        columns = planner.manifests[i].columns["num_records"]
        shards = len(columns) // reading_count(repeat)
        units = [("ranges", stream_work.get("ranges", []))]
        units += [("a saved window", u.get("ranges", [])) for u in stream_work.get("windows", [])]
        if _ranges_fit([r for _, ranges in units for r in ranges], columns):
            continue
        for what, ranges in units:  # which one does not, and why
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


def _ranges_fit(ranges: list, columns) -> bool:
    """Whether each of ``ranges`` is ``(shard, start, stop)``, integers, inside the records of
    its shard (``columns``: each shard's): ``check_work``'s checks over all of a stream's
    ranges at once (where they fail, its loop finds the range and says why)."""
    if not ranges:
        return True
    try:
        table = np.array(ranges)
    except (TypeError, ValueError, OverflowError):
        return False
    if table.dtype.kind != "i" or table.ndim != 2 or table.shape[1] != 3:
        return False
    shard, a, b = table.astype(np.int64).T
    if shard.min() < 0 or shard.max() >= len(columns):
        return False
    return bool(((0 <= a) & (a <= b) & (b <= np.asarray(columns, np.int64)[shard])).all())


def _deal(dataset, stream: int, ranges: list[Range], units: list[dict], n: int, eos: bool, by_docs: bool,
          ahead: np.ndarray):
    """One stream's work cut into ``n`` consecutive parts of near-equal weight (a document's
    weight: its tokens, with EOS; in pad packing 1, its row): ``(ranges, windows' rests,
    tokens, documents)`` per part, and how far each cut fell past its quantile.

    The work is the windows' rests' documents, rest after rest, each in its emission order
    (its window's order from its key, ``pos`` to ``stop``), then the ranges' records in order.
    Each cut goes to the document or record boundary nearest its quantile; a rest a cut falls
    inside is split there into consecutive pieces (``probes.rest_piece``), each a window's rest of its
    own, the first keeping the ``offset`` into its first document (concat packing's carry).
    Only those rests are read from the indexes; the others count as their saved tokens and
    documents. ``ahead``: how far the streams before this one cut past their quantiles (the
    running sums of the parts' weights), taken off this stream's, so that the roundings of
    several streams do not add up on one worker."""
    planner = dataset.planner
    r_tokens, r_docs = _record_sums(planner, stream, ranges, eos)
    u_tokens = np.array([int(u["tokens"]) for u in units], np.int64)
    u_docs = np.array([int(u["docs"]) for u in units], np.int64)
    u_cum = np.concatenate([[0], np.cumsum(u_docs if by_docs else u_tokens)])
    whole = int(u_cum[-1]) + int((r_docs if by_docs else r_tokens)[-1])
    targets = np.clip(whole * np.arange(1, n) / n - ahead, 0, whole)
    at = np.searchsorted(u_cum, targets, side="right") - 1
    split = sorted({int(j) for j, t in zip(at.tolist(), targets.tolist())
                    if j < len(units) and t > u_cum[j] and u_docs[j] > 1})
    # the items to cut between: a rest whole, or the documents of one a cut falls inside
    docs_of = dict(zip(split, units_doc_tokens(dataset, stream, [units[j] for j in split])))
    tokens, docs, first = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [0]
    for j in range(len(units)):
        each = docs_of.get(j)
        tokens.append(u_tokens[j : j + 1] if each is None else each)
        docs.append(u_docs[j : j + 1] if each is None else np.ones(len(each), np.int64))
        first.append(first[-1] + len(tokens[-1]))
    tokens, docs = np.concatenate(tokens).astype(np.int64), np.concatenate(docs).astype(np.int64)
    c_tokens, c_docs = np.concatenate([[0], np.cumsum(tokens)]), np.concatenate([[0], np.cumsum(docs)])
    # then the ranges' records, their running sums carried on
    c_tokens = np.concatenate([c_tokens, c_tokens[-1] + r_tokens[1:]])
    c_docs = np.concatenate([c_docs, c_docs[-1] + r_docs[1:]])
    cum = c_docs if by_docs else c_tokens
    bounds = _bounds(cum, targets)
    starts = np.concatenate([[0], np.cumsum([b - a for _, a, b in ranges])]).astype(np.int64).tolist()
    parts, windows = [], []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        mine = []
        for j in range(bisect.bisect_right(first, lo) - 1, bisect.bisect_left(first, hi)):  # the rests it overlaps
            if not 0 <= j < len(units):
                continue
            a, b = max(lo, first[j]) - first[j], min(hi, first[j + 1]) - first[j]
            if a < b:
                unit = units[j]
                if j not in docs_of:
                    mine.append(dict(unit))
                else:  # the piece's tokens from the running sums, as rest_piece would sum them
                    held = int(c_tokens[first[j] + b] - c_tokens[first[j] + a])
                    mine.append(rest_piece(unit, docs_of[j], a, b, held))
        windows.append(mine)
        parts.append(_records(ranges, starts, max(lo - first[-1], 0), max(hi - first[-1], 0)))
    past = cum[bounds[1:-1]] - whole * np.arange(1, n) / n
    return (parts, windows, np.diff(c_tokens[bounds]).astype(np.int64), np.diff(c_docs[bounds]).astype(np.int64),
            past)


def _record_sums(planner, stream: int, ranges: list[Range], eos: bool) -> tuple[np.ndarray, np.ndarray]:
    """Running sums of the records' tokens (with EOS) and non-empty documents (0 or 1),
    ``ranges`` in order: 0, then one after each record (from the ranges' index prefixes)."""
    if not ranges:
        return np.zeros(1, np.int64), np.zeros(1, np.int64)
    prefixes = [planner._prefix_of(stream, shard) for shard, _, _ in ranges]
    tokens = np.concatenate([p[0][a : b + 1] for p, (_, a, b) in zip(prefixes, ranges)]).astype(np.int64)
    docs = np.concatenate([p[1][a : b + 1] for p, (_, a, b) in zip(prefixes, ranges)]).astype(np.int64)
    if eos:
        tokens += docs
    sizes = np.array([b - a + 1 for _, a, b in ranges], np.int64)  # a range's prefix values
    firsts = np.cumsum(sizes) - sizes
    after = np.ones(len(tokens), bool)  # a value after a record, not a range's first
    after[firsts] = False
    out = []
    for prefix in (tokens, docs):
        held = prefix[firsts + sizes - 1] - prefix[firsts]  # each range's
        shift = prefix[firsts] - (np.cumsum(held) - held)  # its prefix less the ranges' before it
        out.append(np.concatenate([[0], (prefix - np.repeat(shift, sizes))[after]]))
    return out[0], out[1]


def _bounds(cum: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Item boundaries cutting running sums ``cum`` into ``len(targets) + 1`` consecutive
    parts, each cut at the boundary nearest its target."""
    n = len(targets) + 1
    upper = np.minimum(np.searchsorted(cum, targets, side="left"), len(cum) - 1)
    lower = np.maximum(upper - 1, 0)
    nearer_lower = (upper > 0) & (cum[upper] - targets > targets - cum[lower])
    cuts = np.maximum.accumulate(np.where(nearer_lower, lower, upper)) if n > 1 else np.zeros(0, np.int64)
    return np.concatenate([[0], cuts, [len(cum) - 1]]).astype(np.int64)


def _records(ranges: list[Range], starts: list[int], lo: int, hi: int) -> list[Range]:
    """Records ``lo..hi-1`` of ``ranges`` (in order; ``starts``: each one's first, then their
    total) as ``(shard, start, stop)`` ranges."""
    piece: list[Range] = []
    j = bisect.bisect_right(starts, lo) - 1
    while lo < hi:
        shard, a, b = ranges[j]
        take = min(hi, starts[j + 1]) - lo
        first = a + lo - starts[j]
        piece.append((shard, first, first + take))
        lo += take
        j += 1
    return piece


def remaining_plan(dataset, work: Work, *, world_size: int, workers_per_rank: int, batch_size: int | StepSchedule,
                   first_step: int) -> PassPlan:
    """The plan of the rest of pass ``work["pass"]`` on this topology (steps equal on every
    rank: every rank computes it from the same saved state). The cycle collector is paused:
    dealing a large rest makes hundreds of thousands of small lists and dicts, none in a cycle,
    and the full collections they set off cost about as much as the deal (1024x8 -> 768x8:
    1.5-1.8 s with them, 1.1 s without, on a loaded machine)."""
    with collector.paused():
        return _remaining_plan(dataset, work, world_size=world_size, workers_per_rank=workers_per_rank,
                               batch_size=batch_size, first_step=first_step)


def _remaining_plan(dataset, work: Work, *, world_size: int, workers_per_rank: int,
                    batch_size: int | StepSchedule, first_step: int) -> PassPlan:
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
        t, d = dataset.planner.totals(i, stream_work["ranges"])
        total = t + (d if eos else 0)
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
