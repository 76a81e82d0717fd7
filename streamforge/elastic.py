"""Elastic resume: the rest of a pass, re-planned over another topology, every token once.

A global state (``state.py``) holds every saved worker's cursors. From them, with record
indexes only (no tokens), ``work_left`` lists what the saved job had not handed out in the
current pass, per stream:

* ``ranges``: records no worker had read yet (the tails of the workers' ranges);
* ``partials``: documents read into a shuffle window but not wholly emitted, as
  ``(shard, record, token_start)``: ``token_start`` is 0 for a document still waiting in its
  window and the first token not yet delivered for the one a batch ended inside.

Documents in shuffle windows and the packer's carry (in concat packing, the current
document's token offset) are thus part of the work, not lost. ``assign_work`` deals it to
the new topology deterministically: the ranges, sorted, are cut at exact token quantiles
(per-record lengths from the shard indexes), and partial documents go round-robin. Each new
worker reads its ranges through a fresh window shuffle and emits its partial documents first
(``ShuffleBuffer`` windows -k..-1, in stored order, each shuffled). ``remaining_plan`` makes a ``PassPlan`` of it, so the steps
left are equal on every rank. Chained restarts work the same way: the plan of a resumed pass
is itself built from the saved work, so its workers' cursors are read against it.

The result is JSON-able and goes into the loader's state (``remaining``), so an exact resume
of a resumed job rebuilds the same plan.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Sequence

import numpy as np

from .plan import PassPlan, Range, steps_for, worker_rows

Work = dict[str, Any]  # {"pass": p, "streams": [{"ranges": [[s, a, b], ...], "partials": [[s, r, t], ...]}, ...]}


def work_left(dataset, state: dict[str, Any]) -> Work:
    """What the saved job had not handed out in its current pass (see the module docstring)."""
    saved_g = int(state["world_size"]) * int(state["workers_per_rank"])
    saved_w = int(state["workers_per_rank"])
    pass_idx = int(state["pass"])
    previous = (state.get("remaining") or {}).get("work")
    assigned = assign_work(dataset, previous, saved_g) if previous else None
    streams = [{"ranges": [], "partials": []} for _ in dataset.streams]
    for part in state["ranks"]:
        for w, worker_state in enumerate(part["workers"]):
            g = int(part["rank"]) * saved_w + w
            buffers = _probe_buffers(dataset, pass_idx, saved_g, g, assigned, int(state["generation"]))
            if worker_state is None:  # nothing handed out: all of its work is left
                for i, buffer in enumerate(buffers):
                    streams[i]["ranges"] += [list(r) for r in buffer.reader.ranges_for(pass_idx)]
                    streams[i]["partials"] += [list(p) for p in buffer.partials_for(pass_idx)]
                continue
            from .dataset import WorkerPipeline

            for i, (buffer, stream_state) in enumerate(zip(buffers, WorkerPipeline.stream_states(worker_state))):
                p, ranges, pending = buffer.work_left(stream_state)
                if p != pass_idx:  # a finite reader never leaves its pass
                    continue
                streams[i]["ranges"] += [list(r) for r in ranges]
                streams[i]["partials"] += [list(d) for d in pending]
    for s in streams:
        s["ranges"] = _merge(sorted(s["ranges"]))
        s["partials"] = sorted(s["partials"])
    return {"pass": pass_idx, "streams": streams}


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
    from .stages.read import ShardReader
    from .stages.shuffle import ShuffleBuffer

    cfg = dataset.config
    out = []
    for i, stream in enumerate(dataset.streams):
        ranges_for, partials_for = worker_work(dataset, i, num_global, g, pass_idx, assigned)
        reader = ShardReader(dataset._index_source(i), ranges_for=ranges_for, stream_key=stream.name,
                             infinite=False, first_pass=pass_idx)
        out.append(ShuffleBuffer(reader, size=cfg.shuffle_buffer, seed=cfg.seed, stream_key=stream.name,
                                 global_worker=g, eos_id=cfg.eos_id if dataset.eos_appended[i] else None,
                                 partials_for=partials_for, generation=generation))
    return out


def worker_work(dataset, stream: int, num_global: int, g: int, pass_idx: int, assigned):
    """(ranges_for, partials_for) of global worker ``g``: its share of ``assigned`` work in
    ``pass_idx``, the plan's ranges in every other pass."""
    planner = dataset.planner

    def ranges_for(p: int) -> list[Range]:
        if assigned is not None and p == pass_idx:
            return [tuple(r) for r in assigned[stream][0][g]]
        return planner.worker_ranges(stream, p, num_global, g)

    def partials_for(p: int) -> list:
        if assigned is not None and p == pass_idx:
            return [tuple(d) for d in assigned[stream][1][g]]
        return []

    return ranges_for, partials_for


def assign_work(dataset, work: Work, num_global: int) -> list[tuple[list[list[Range]], list[list[tuple]]]]:
    """Per stream, (ranges per global worker, partial documents per global worker): the
    ranges cut at exact token quantiles, partial documents dealt round-robin."""
    out = []
    for i, stream_work in enumerate(work["streams"]):
        eos = dataset.eos_appended[i]
        ranges = [tuple(r) for r in stream_work["ranges"]]
        # the indexes of every shard the split and the counts need, read in parallel
        dataset.planner.prefetch_indexes(i, {r[0] for r in ranges} | {d[0] for d in stream_work["partials"]})
        partials = stream_work["partials"]
        out.append((
            _split(dataset.planner, i, ranges, num_global, eos),
            [list(map(tuple, partials[g::num_global])) for g in range(num_global)],
        ))
    return out


def _split(planner, stream: int, ranges: list[Range], n: int, eos: bool) -> list[list[Range]]:
    """``ranges`` (in order) cut into ``n`` consecutive parts of near-equal tokens, at record
    boundaries chosen from the records' exact lengths."""
    prefix = []  # per range: the eff-token prefix over its records
    for shard, a, b in ranges:
        tokens, docs = planner._prefix_of(stream, shard)
        eff = tokens[a : b + 1] - tokens[a] + ((docs[a : b + 1] - docs[a]) if eos else 0)
        prefix.append(eff)
    sizes = np.array([int(p[-1]) for p in prefix], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    total = int(starts[-1])
    cuts = [(0, 0)]  # (range index, record offset within it)
    for k in range(1, n):
        target = total * k / n
        j = min(int(np.searchsorted(starts[1:], target, side="left")), max(len(ranges) - 1, 0))
        if not ranges:
            cuts.append((0, 0))
            continue
        within = int(np.searchsorted(prefix[j], target - starts[j], side="left"))
        # round to the nearer record boundary
        if 0 < within < len(prefix[j]) and (prefix[j][within] - (target - starts[j])) > (
                (target - starts[j]) - prefix[j][within - 1]):
            within -= 1
        cut = (j, min(within, ranges[j][2] - ranges[j][1]))
        cuts.append(max(cut, cuts[-1]))
    cuts.append((len(ranges), 0))
    parts = []
    for (j0, o0), (j1, o1) in zip(cuts[:-1], cuts[1:]):
        piece: list[Range] = []
        for j in range(j0, min(j1 + 1, len(ranges))):
            shard, a, b = ranges[j]
            lo = a + (o0 if j == j0 else 0)
            hi = a + o1 if j == j1 else b
            if hi > lo:
                piece.append((shard, lo, hi))
        parts.append(piece)
    return parts


def remaining_plan(dataset, work: Work, *, world_size: int, workers_per_rank: int, batch_size: int,
                   first_step: int) -> PassPlan:
    """The plan of the rest of pass ``work["pass"]`` on this topology (steps equal on every
    rank: every rank computes it from the same saved state)."""
    n = world_size * workers_per_rank
    assigned = assign_work(dataset, work, n)
    planner = dataset.planner
    cfg = dataset.config
    tokens = np.zeros(n, np.int64)
    docs = np.zeros(n, np.int64)
    for i, (ranges, _) in enumerate(assigned):
        eos = dataset.eos_appended[i]
        for g in range(n):
            for shard, a, b in ranges[g]:
                t, d = planner.counts(i, shard, a, b)
                tokens[g] += t + (d if eos else 0)
                docs[g] += d
        # partial documents (dealt round-robin: the k-th goes to worker k % n), vectorized
        t, count = _partial_tokens(planner, i, work["streams"][i]["partials"], n, dataset.eos_appended[i])
        tokens += t
        docs += count
    tokens = [int(t) for t in tokens]
    rows = [worker_rows(t, int(d), seq_len=cfg.seq_len, packing=cfg.packing) for t, d in zip(tokens, docs)]
    steps = steps_for(rows, world_size=world_size, workers_per_rank=workers_per_rank, batch_size=batch_size)
    return PassPlan(
        pass_idx=int(work["pass"]), world_size=world_size, workers_per_rank=workers_per_rank,
        batch_size=batch_size, seq_len=cfg.seq_len, packing=cfg.packing, streams=list(dataset.stream_names),
        ranges=[a[0] for a in assigned], tokens=tokens, rows=rows, steps=steps, first_step=first_step,
        partials=[a[1] for a in assigned],
    )


def _partial_tokens(planner, stream: int, partials: list, n: int, eos: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per global worker of ``n``: the tokens left of its partial documents (the ``k``-th
    partial is worker ``k % n``'s) and how many there are; what ``planner.counts`` of each
    document's record gives, minus its ``token_start``."""
    if not len(partials):
        return np.zeros(n, np.int64), np.zeros(n, np.int64)
    flat = np.fromiter(chain.from_iterable(partials), np.int64, 3 * len(partials)).reshape(-1, 3)
    shard, record, start = flat[:, 0], flat[:, 1], flat[:, 2]
    shards, which = np.unique(shard, return_inverse=True)
    m = planner.manifests[stream]
    lengths, base = [], [0]  # each shard's record lengths, laid end to end
    for s in shards.tolist():
        if int(m.columns["num_records"][s]) == 1 and "num_docs" in m.columns:  # counts() uses the manifest
            t, d = int(m.columns["num_tokens"][s]), int(m.columns["num_docs"][s])
            lengths.append(np.array([t + (d if eos else 0)], np.int64))
        else:
            tok, doc = planner._prefix_of(stream, s)
            lengths.append(np.diff(tok) + (np.diff(doc) if eos else 0))
        base.append(base[-1] + len(lengths[-1]))
    length = np.concatenate(lengths)[np.asarray(base[:-1], np.int64)[which] + record]
    owner = np.arange(len(flat)) % n
    return (np.bincount(owner, weights=length - start, minlength=n).astype(np.int64),
            np.bincount(owner, minlength=n).astype(np.int64))


def work_tokens(dataset, work: Work) -> list[int]:
    """Tokens left per stream in ``work``."""
    out = []
    for i, stream_work in enumerate(work["streams"]):
        eos = dataset.eos_appended[i]
        total = 0
        for shard, a, b in stream_work["ranges"]:
            t, d = dataset.planner.counts(i, shard, a, b)
            total += t + (d if eos else 0)
        for shard, record, start in stream_work["partials"]:
            t, d = dataset.planner.counts(i, shard, record, record + 1)
            total += t + (d if eos else 0) - start
        out.append(total)
    return out


def elastic_blockers(dataset, state: dict[str, Any], differences: Sequence[str]) -> list[str]:
    """Why the saved state cannot resume elastically here (empty: it can)."""
    why = []
    changeable = {"world_size", "workers_per_rank", "batch_size"}
    saved, now = state["config"], dataset.describe()
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
