"""Statistical resume: continue from the same place in each stream when exactness is impossible.

When the topology or the corpus changed, saved cursors point into a plan that no longer
exists. We measure, from the saved workers' states of every rank the global state holds (read
through ``state.saved_workers``, ``WorkerPipeline.stream_states`` and the stages'
``saved_cursor`` accessors, as in ``probes.buffer_position``, never by hand), how
far each stream's pass had gone (records handed on / records assigned, on the saved plan), and
start every new worker that same fraction into its ranges of the new plan for the same pass
(``WorkerPipeline.seek``). The report lists what that approximates.
"""

from __future__ import annotations

from typing import Any

from ..pipeline.dataset import WorkerPipeline
from ..pipeline.worker import WorkerState
from ..planning.plan import records_at, trim_ranges
from ..stages.read import ShardReader
from ..stages.shuffle import ShuffleBuffer
from ..stages.window_order import window_size
from .probes import buffer_position, reader_position
from .state import config_value, saved_ranks, saved_workers


def stream_positions(dataset, saved: dict[str, Any]) -> tuple[list[tuple[int, float]], list[str]]:
    """Per current stream, (pass, fraction of its ranges consumed) from a saved state, and
    notes for the report."""
    config = saved["config"]
    saved_streams = {s["name"]: (i, s) for i, s in enumerate(config.get("streams", []))}
    saved_world, saved_w = int(saved["world_size"]), int(saved["workers_per_rank"])
    have = saved_ranks(saved)
    workers = saved_workers(saved)
    pass_idx = int(saved["pass"])
    planner = dataset.planner
    notes: list[str] = []
    out = []
    for i, (stream, manifest) in enumerate(zip(dataset.streams, dataset.manifests)):
        entry = saved_streams.get(stream.name)
        if entry is None:
            notes.append(f"stream {stream.name!r} is new: it starts at the beginning of pass {pass_idx}")
            out.append((pass_idx, 0.0))
            continue
        j, saved_stream = entry
        if saved_stream["manifest"] != manifest.fingerprint:
            notes.append(f"stream {stream.name!r}: its corpus changed; pass {pass_idx} restarts from its beginning")
            out.append((pass_idx, 0.0))
            continue
        rows = []
        for g, worker_state in workers:

            def ranges_for(p: int, _g=g) -> list:
                return planner.worker_ranges(i, p, saved_world * saved_w, _g)

            total_of = lambda p: sum(b - a for _, a, b in ranges_for(p))  # noqa: E731
            if worker_state is None:
                rows.append((pass_idx, 0, total_of(pass_idx)))
                continue
            p, done = buffer_position(WorkerPipeline.stream_states(worker_state)[j], ranges_for)
            total = total_of(p)
            rows.append((p, min(done, total), total))
        stream_pass = min(r[0] for r in rows)
        fractions = [(r[1] / r[2] if r[2] else 1.0) if r[0] == stream_pass else 1.0 for r in rows]
        fraction = sum(fractions) / len(fractions)
        consumed = sum(r[1] for r in rows if r[0] == stream_pass)
        assigned = sum(r[2] for r in rows if r[0] == stream_pass)
        whose = f"the saved job ({len(have)} ranks)" if len(have) == saved_world else f"saved rank(s) {have}"
        notes.append(
            f"stream {stream.name!r}: pass {stream_pass}, {fraction:.1%} consumed over {whose} "
            f"({consumed} of {assigned} records over {len(rows)} saved workers); every new worker "
            f"starts {fraction:.1%} into its ranges of the new plan"
        )
        out.append((stream_pass, fraction))
    return out, notes


def statistical_worker_states(dataset, positions, num_logical: int) -> list[WorkerState]:
    """A fresh state for each of this rank's ``num_logical`` workers, each stream
    ``fraction`` of the way into the worker's ranges of its pass."""
    states = []
    n = dataset.world_size * num_logical
    for w in range(num_logical):
        pipeline = dataset.make_pipeline(w, num_logical, first_pass=positions[0][0] if positions else 0)
        g = pipeline.global_worker
        seek = [
            (p, records_at(dataset.planner.worker_ranges(i, p, n, g), f))
            for i, (p, f) in enumerate(positions)
        ]
        pipeline.seek(seek)
        states.append(pipeline.state_dict())
        pipeline.close()
    return states


# -- bounds ------------------------------------------------------------------------------------

def statistical_bounds(dataset, saved: dict[str, Any], positions, num_logical: int) -> list[tuple[int, int] | None]:
    """Per stream, (records that may be seen twice, records that may be skipped) in the
    current pass by a statistical resume to ``positions`` on this topology; None where the
    stream starts its pass afresh or the saved pass plan is not the planner's.

    In record space: the saved workers certainly handed on the records before their window
    cursors (``O``); the records of their current windows (``U``) may or may not have been,
    and a saved rank missing from the state may have handed on any of its records. The new
    workers skip the first ``fraction`` of their new ranges (``N``). Read twice: at most
    ``|(O + U) - N|``; never read: at most ``|N - O|``.
    """
    saved_g = int(saved["world_size"]) * int(saved["workers_per_rank"])
    states = dict(saved_workers(saved))
    if (saved.get("remaining") or {}).get("work"):
        return [None] * len(dataset.streams)
    names = {s["name"]: j for j, s in enumerate(saved["config"].get("streams", []))}
    # the saved workers' windows had the saved sizes
    size = int(config_value(saved["config"], "shuffle_buffer", dataset.config.shuffle_buffer))
    warmup = int(config_value(saved["config"], "shuffle_warmup"))
    new_g = dataset.world_size * num_logical
    planner = dataset.planner
    out: list[tuple[int, int] | None] = []
    for i, (stream, (pass_idx, fraction)) in enumerate(zip(dataset.streams, positions)):
        j = names.get(stream.name)
        if j is None or fraction == 0.0:
            out.append(None)
            continue
        certain, maybe = [], []
        for g in range(saved_g):
            ranges = planner.worker_ranges(i, pass_idx, saved_g, g)
            state = states.get(g, "missing")
            if state == "missing":
                maybe += ranges
                continue
            if state is None:
                continue
            buffer = ShuffleBuffer.saved_cursor(WorkerPipeline.stream_states(state)[j])
            if ShardReader.saved_cursor(buffer.reader).pass_idx != pass_idx:
                certain += ranges  # that worker's stream had finished this pass
                continue
            before = reader_position(buffer.reader, ranges)
            certain += _prefix(ranges, before)
            if buffer.loaded:
                maybe += _prefix(trim_ranges(ranges, before), window_size(size, warmup, buffer.window))
        skipped = []
        for h in range(new_g):
            ranges = planner.worker_ranges(i, pass_idx, new_g, h)
            skipped += _prefix(ranges, records_at(ranges, fraction))
        seen = _merge(certain + maybe)
        jumped = _merge(skipped)
        out.append((_count(_minus(seen, jumped)), _count(_minus(jumped, _merge(certain)))))
    return out


def _prefix(ranges, records: int) -> list:
    out = []
    for shard, a, b in ranges:
        if records <= 0:
            break
        take = min(records, b - a)
        out.append((shard, a, a + take))
        records -= take
    return out


def _merge(ranges) -> dict[int, list[tuple[int, int]]]:
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for shard, a, b in sorted(ranges):
        spans = by_shard.setdefault(int(shard), [])
        if spans and a <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], b))
        elif b > a:
            spans.append((a, b))
    return by_shard


def _minus(left: dict, right: dict) -> dict:
    out = {}
    for shard, spans in left.items():
        cut = right.get(shard, [])
        kept, k = [], 0
        for a, b in spans:
            while k < len(cut) and cut[k][1] <= a:
                k += 1
            m = k
            while a < b and m < len(cut) and cut[m][0] < b:
                if cut[m][0] > a:
                    kept.append((a, cut[m][0]))
                a = max(a, cut[m][1])
                m += 1
            if a < b:
                kept.append((a, b))
        out[shard] = kept
    return out


def _count(spans: dict) -> int:
    return sum(b - a for s in spans.values() for a, b in s)
