"""Statistical resume: continue from the same place in each stream when exactness is impossible.

When the topology (world size, workers per rank) or the corpus changed, saved cursors point
into a plan that no longer exists. We then measure, from this rank's saved worker states,
how far each stream's pass had gone (records consumed / records assigned), and start every
new worker that same fraction into its ranges of the new plan for the same pass. The mixture
counters restart (so shares hold from the resume on), and the documents that were pending
in shuffle windows and in the packer's carry are not replayed. Every one of these
approximations is listed in the resume report.
"""

from __future__ import annotations

from typing import Any

from .plan import plan_for_manifest


def _consumed(manifest, name: str, seed: int, num_global: int, global_worker: int, buffer_state, epoch: int):
    """(pass, records consumed, records assigned) of one saved worker for one stream."""
    if buffer_state is None:
        ranges = plan_for_manifest(manifest, seed=seed, stream_key=name, pass_idx=epoch,
                                   num_global_workers=num_global)[global_worker]
        return epoch, 0, sum(b - a for _, a, b in ranges)
    cursor = buffer_state["reader"]
    pass_idx = int(cursor["pass"])
    ranges = plan_for_manifest(manifest, seed=seed, stream_key=name, pass_idx=pass_idx,
                               num_global_workers=num_global)[global_worker]
    done = sum(b - a for _, a, b in ranges[: cursor["range"]]) + int(cursor["offset"])
    if buffer_state.get("loaded"):
        done += int(buffer_state["pos"])  # documents of the window already handed on (approx.)
    total = sum(b - a for _, a, b in ranges)
    return pass_idx, min(done, total), total


def _cursor_at(ranges, skip: int) -> dict[str, int]:
    for i, (_, a, b) in enumerate(ranges):
        if skip < b - a:
            return {"range": i, "offset": skip}
        skip -= b - a
    return {"range": len(ranges), "offset": 0}


def statistical_worker_states(dataset, saved: dict[str, Any], num_logical: int):
    """New per-worker pipeline states for ``dataset`` approximating ``saved``, and notes."""
    config = saved["config"]
    saved_streams = {s["name"]: (i, s) for i, s in enumerate(config.get("streams", []))}
    saved_world = int(config.get("world_size", 1))
    saved_w = int(config.get("workers_per_rank", len(saved["workers"])))
    saved_seed = int(config.get("seed", dataset.config.seed))
    epoch = int(saved["epoch"])
    rank = dataset.rank
    notes: list[str] = []
    per_stream = []  # (pass, fraction) per current stream
    for stream, manifest in zip(dataset.streams, dataset.manifests):
        entry = saved_streams.get(stream.name)
        if entry is None:
            notes.append(f"stream {stream.name!r} is new: it starts at the beginning of pass {epoch}")
            per_stream.append((epoch, 0.0))
            continue
        j, saved_stream = entry
        if saved_stream["manifest"] != manifest.fingerprint:
            notes.append(f"stream {stream.name!r}: its corpus changed; pass {epoch} restarts from its beginning")
            per_stream.append((epoch, 0.0))
            continue
        rows = []
        for w, worker_state in enumerate(saved["workers"]):
            buffer_state = None
            if worker_state is not None:
                buffer_state = worker_state["source"]["sources"][j]
            rows.append(_consumed(manifest, stream.name, saved_seed, saved_world * saved_w,
                                  rank * saved_w + w, buffer_state, epoch))
        pass_idx = min(r[0] for r in rows)
        fractions = [(r[1] / r[2] if r[2] else 1.0) if r[0] == pass_idx else 1.0 for r in rows]
        fraction = sum(fractions) / len(fractions)
        consumed = sum(r[1] for r in rows if r[0] == pass_idx)
        assigned = sum(r[2] for r in rows if r[0] == pass_idx)
        notes.append(
            f"stream {stream.name!r}: pass {pass_idx}, {fraction:.1%} consumed on this rank "
            f"({consumed} of {assigned} records over {len(rows)} saved workers); every new worker "
            f"starts {fraction:.1%} into its ranges of the new plan, so records near that cut may "
            "be read twice or not at all in this pass"
        )
        per_stream.append((pass_idx, fraction))
    notes.append("documents pending in shuffle windows and the packer's carry at save time are not replayed")
    notes.append("mixture counters restart at zero: token shares hold from the resume on")
    num_global = dataset.world_size * num_logical
    states = []
    for w in range(num_logical):
        global_worker = rank * num_logical + w
        buffers = []
        for stream, manifest, (pass_idx, fraction) in zip(dataset.streams, dataset.manifests, per_stream):
            ranges = plan_for_manifest(manifest, seed=dataset.config.seed, stream_key=stream.name,
                                       pass_idx=pass_idx, num_global_workers=num_global)[global_worker]
            total = sum(b - a for _, a, b in ranges)
            cursor = {"pass": pass_idx, **_cursor_at(ranges, int(round(fraction * total)))}
            buffers.append({"reader": cursor, "window": 0, "loaded": False, "pos": 0, "token_offset": 0})
        interleaver = {"emitted": [0] * len(buffers), "current": -1, "sources": buffers}
        states.append({"source": interleaver, "window": None, "rows_emitted": 0})
    return states, notes
