"""Loader state: one global state for the whole job, its version, and what a resume did.

``StreamingLoader.state_dict()`` returns the same small dict on every rank::

    {"version": 4, "step": s, "pass": p, "world_size": R, "state": "<JSON>", "digest": "<sha256>"}

The flat outer keys never change shape, so ``torch.distributed.checkpoint`` (which treats
non-tensor values as replicated and loads into the keys of a fresh loader's state) round-trips
it, and so does ``torch.save``. ``unpack_state`` gives the JSON part as plain data, the
*global state*::

    {"version": 4, "fingerprint": "...", "config": {...},
     "world_size": R, "workers_per_rank": W, "batch_size": B,
     "step": s, "pass": p, "pass_first_step": s0, "batch": i,
     "skip_steps": [[a, b], ...], "remaining": null, {"work": ...} or {"fractions": [...]},
     "generation": statistical resumes behind the job (each reshuffles the windows),
     "ranks": [{"rank": r, "workers": [pipeline state or None, ...], "pass_tokens": t,
                "counters": {...}, "skipped": [...]}, ...]}

``step`` is the global step of the next batch (the same on every rank); ``batch`` every
rank's next local batch in the pass (``step = pass_first_step + batch``), which comes from
worker ``batch % W``. ``ranks[r]`` is rank ``r``'s part: the cursors of its W workers. Under
torch.distributed the parts are gathered at checkpoint time (one all-gather of a few KB per
rank); without a process group each rank's state holds its own part only (the others None)
and ``merge_states`` joins them.

``digest`` is the SHA-256 of the ``state`` text: a state whose text changed by one byte
after ``state_dict()`` wrote it (an edit, a bit flip, a truncation) is refused with
``ResumeMismatchError`` before any of it is read, since a changed cursor would otherwise
resume "exactly" on other batches. It guards against accidents, not against someone who
recomputes it: the values are also checked (``check_values``, then each stage's
``check_state``), each refusal naming the field. Deliberate changes go through the API
(``skip_steps``, ``mode="statistical"``, ``merge_states``). A version-3 state (before the
digest) still loads, its values checked, and ``resume_report`` says it could not be verified.

``config`` holds every value exactness depends on (stream names, weights and manifest
fingerprints; seed; world size R; workers per rank W; seq_len; packing; boundary; shuffle
buffer; batch size...), so a mismatch can be named, not just detected. The fingerprint is a
digest of ``config``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import ResumeMismatchError

STATE_VERSION = 4
UNDIGESTED_VERSION = 3  # the last version without a digest: still read, its values checked
OUTER_KEYS = ("version", "step", "pass", "world_size", "state", "digest")
STATE_KEYS = (
    "version", "fingerprint", "config", "world_size", "workers_per_rank", "batch_size", "step", "pass",
    "pass_first_step", "batch", "skip_steps", "remaining", "generation", "ranks",
)
RANK_KEYS = ("rank", "workers", "pass_tokens", "counters", "skipped")
MODES = ("exact", "elastic", "statistical")
_SAME_ACROSS_RANKS = ("fingerprint", "world_size", "workers_per_rank", "batch_size", "step", "pass",
                      "pass_first_step", "batch", "remaining", "generation")


def fingerprint(config: dict[str, Any]) -> str:
    blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def pack_state(state: dict[str, Any]) -> dict[str, Any]:
    """The outer dict of a global state (see the module docstring), with its digest."""
    text = json.dumps(dict(state, version=STATE_VERSION), separators=(",", ":"))
    return {
        "version": STATE_VERSION, "step": int(state["step"]), "pass": int(state["pass"]),
        "world_size": int(state["world_size"]), "state": text, "digest": _digest(text),
    }


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def content_digest(value: Any) -> str:
    """SHA-256 of plain data, the same after a round trip through JSON (keys sorted)."""
    try:
        return _digest(json.dumps(value, sort_keys=True, separators=(",", ":")))
    except (TypeError, ValueError) as exc:
        raise ResumeMismatchError(f"a loader state holds a value JSON cannot hold ({exc})") from None


def unpack_state(state: Any) -> dict[str, Any]:
    """The global state inside a loader state (plain data), checked for version and keys."""
    if not isinstance(state, dict):
        raise ResumeMismatchError(f"loader state must be a dict, got {type(state).__name__}")
    version = state.get("version")
    if version == 2:
        return _from_version_2(state)
    if version not in (STATE_VERSION, UNDIGESTED_VERSION) or isinstance(version, bool):
        hint = ""
        if isinstance(version, int) and version < 2:
            hint = (" (written before the global step existed: it has no step, rank or plan to resume from; "
                    "start the data order afresh or resume with the streamforge that wrote it)")
        raise ResumeMismatchError(f"loader state version {version!r}, this streamforge reads {STATE_VERSION}{hint}")
    text = state.get("state")
    if not isinstance(text, (str, bytes)):
        raise ResumeMismatchError(f"loader state: 'state' holds {type(text).__name__}, not the global state's JSON")
    if version == STATE_VERSION:
        digest = state.get("digest")
        if not isinstance(digest, str) or digest != _digest(text):
            raise ResumeMismatchError(
                "loader state: its digest does not match its content: the state was changed after "
                "state_dict() wrote it (edited, truncated or corrupted), so its cursors cannot be trusted. "
                "Resume from an unchanged copy; to change where a job goes on, use the API "
                "(skip_steps=, load_state_dict(mode='statistical'), merge_states)"
            )
    try:
        inner = json.loads(text)
    except ValueError as exc:
        raise ResumeMismatchError(f"loader state: the 'state' field is not valid JSON ({exc})") from None
    if not isinstance(inner, dict):
        raise ResumeMismatchError(f"loader state: 'state' holds {type(inner).__name__}, not the global state")
    missing = [k for k in STATE_KEYS if k not in inner]
    if missing:
        raise ResumeMismatchError(f"loader state lacks {missing}")
    check_values(inner)
    for key in ("version", "step", "pass", "world_size"):
        if key in state and state[key] != inner[key]:
            raise ResumeMismatchError(f"loader state: the outer {key!r} is {state[key]!r}, the state's own {inner[key]!r}")
    if version == UNDIGESTED_VERSION:
        inner["undigested"] = True
    return inner


def _field(name: str, value: Any, low: int = 0) -> None:
    if type(value) is not int or value < low:
        raise ResumeMismatchError(f"loader state: {name} is {value!r}, expected an integer >= {low}")


def check_values(inner: dict[str, Any]) -> None:
    """The global state's own fields and each rank part's, by type and range: a state that
    passes its digest but was built by hand (or by an older streamforge) gets a named
    refusal here, never a bare error later. Stage cursors are checked by their stages."""
    for key in ("step", "pass", "pass_first_step", "batch", "generation"):
        _field(key, inner[key])
    for key in ("world_size", "workers_per_rank", "batch_size"):
        _field(key, inner[key], 1)
    if inner["step"] != inner["pass_first_step"] + inner["batch"]:
        raise ResumeMismatchError(
            f"loader state: step {inner['step']} is not pass_first_step {inner['pass_first_step']} + batch "
            f"{inner['batch']}"
        )
    if not isinstance(inner["fingerprint"], str) or not isinstance(inner["config"], dict):
        raise ResumeMismatchError("loader state: fingerprint must be a string and config a mapping")
    skips = inner["skip_steps"]
    if not isinstance(skips, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(type(x) is int and x >= 0 for x in r) for r in skips):
        raise ResumeMismatchError(f"loader state: skip_steps must be [[start, end], ...] of steps, got {skips!r}")
    remaining = inner["remaining"]
    if remaining is not None and not (isinstance(remaining, dict) and len(remaining) == 1
                                      and next(iter(remaining)) in ("work", "fractions")):
        raise ResumeMismatchError(f"loader state: remaining must be null, {{'work': ...}} or {{'fractions': [...]}}, "
                                  f"got {str(remaining)[:80]}")
    ranks = inner["ranks"]
    if not isinstance(ranks, list) or len(ranks) != inner["world_size"]:
        raise ResumeMismatchError(
            f"loader state: 'ranks' must list one part per rank of the saved job ({inner['world_size']}), "
            f"got {len(ranks) if isinstance(ranks, list) else type(ranks).__name__}"
        )
    for r, part in enumerate(ranks):
        if part is None:
            continue
        if not isinstance(part, dict):
            raise ResumeMismatchError(f"loader state: ranks[{r}] holds {type(part).__name__}, not a rank's part")
        lacking = [k for k in RANK_KEYS if k not in part]
        if lacking or part["rank"] != r:
            raise ResumeMismatchError(f"loader state: ranks[{r}] " + (
                f"lacks {lacking}" if lacking else f"holds the part of rank {part['rank']!r}"))
        _field(f"ranks[{r}].pass_tokens", part["pass_tokens"])
        workers = part["workers"]
        if not isinstance(workers, list) or len(workers) != inner["workers_per_rank"] or not all(
                w is None or isinstance(w, dict) for w in workers):
            raise ResumeMismatchError(
                f"loader state: ranks[{r}].workers must list {inner['workers_per_rank']} worker states (or nulls)")
        if not isinstance(part["counters"], dict) or not isinstance(part["skipped"], list):
            raise ResumeMismatchError(f"loader state: ranks[{r}].counters must be a mapping and skipped a list")


_V2_KEYS = ("fingerprint", "config", "rank", "world_size", "workers_per_rank", "step", "pass", "pass_first_step",
            "batch", "pass_tokens", "workers", "skip_steps", "counters")


def _from_version_2(state: dict[str, Any]) -> dict[str, Any]:
    """A version-2 state (one rank's, before states were global) as a global state holding
    that rank's part; marked ``upgraded_from`` so the loader resumes it statistically."""
    missing = [k for k in _V2_KEYS if k not in state]
    if missing:
        raise ResumeMismatchError(f"loader state version 2 lacks {missing}")
    world, rank = int(state["world_size"]), int(state["rank"])
    ranks: list[Any] = [None] * world
    ranks[rank] = {"rank": rank, "workers": state["workers"], "pass_tokens": state["pass_tokens"],
                   "counters": state["counters"], "skipped": state.get("skipped", [])}
    fractions = state.get("remaining")
    return {
        "version": STATE_VERSION, "fingerprint": state["fingerprint"], "config": state["config"],
        "world_size": world, "workers_per_rank": int(state["workers_per_rank"]),
        "batch_size": state["config"].get("batch_size"), "step": state["step"], "pass": state["pass"],
        "pass_first_step": state["pass_first_step"], "batch": state["batch"], "skip_steps": state["skip_steps"],
        "remaining": {"fractions": fractions} if fractions else None, "generation": 0, "ranks": ranks,
        "upgraded_from": 2,
    }


def saved_ranks(state: dict[str, Any]) -> list[int]:
    """The ranks whose parts a global state holds."""
    return [r for r, part in enumerate(state["ranks"]) if part is not None]


def saved_workers(state: dict[str, Any]) -> list[tuple[int, dict[str, Any] | None]]:
    """(global worker, its saved ``WorkerPipeline`` state or None) for every worker of the
    ranks whose parts a global state holds, by rank then worker: the one walk over the
    saved workers (read each one's streams with ``WorkerPipeline.stream_states``)."""
    per_rank = int(state["workers_per_rank"])
    return [(int(part["rank"]) * per_rank + w, worker_state) for part in state["ranks"] if part is not None
            for w, worker_state in enumerate(part["workers"])]


def merge_states(states: Sequence[Any]) -> dict[str, Any]:
    """One loader state from the states of the job's ranks, each holding its own part
    (states saved without a process group); raises naming what disagrees."""
    if not states:
        raise ResumeMismatchError("merge_states needs at least one state")
    inner = [unpack_state(s) for s in states]
    first = inner[0]
    merged = dict(first, ranks=list(first["ranks"]))
    for i, other in enumerate(inner[1:], 1):
        for key in _SAME_ACROSS_RANKS:
            if other[key] != first[key]:
                raise ResumeMismatchError(
                    f"merge_states: state {i} has {key} {other[key]!r}, state 0 {first[key]!r}: "
                    "the states are not of the same job and step"
                )
        for r in saved_ranks(other):
            if merged["ranks"][r] is not None and merged["ranks"][r] != other["ranks"][r]:
                raise ResumeMismatchError(f"merge_states: two different parts for rank {r}")
            merged["ranks"][r] = other["ranks"][r]
        merged["skip_steps"] = sorted({tuple(x) for x in merged["skip_steps"]} | {tuple(x) for x in other["skip_steps"]})
    merged["skip_steps"] = [list(x) for x in merged["skip_steps"]]
    merged.pop("undigested", None)
    return pack_state(merged)


# What a config field meant before it was saved: a state without the key had that value.
# A config leaves such a field out while it has that value (``saved_config``), so states saved
# before the field existed keep their fingerprints.
ABSENT_MEANS = {"shuffle_warmup": 0, "cuts": "records"}
# Fields that states once saved but that never change the data order, only how a batch is
# expanded (now the loader's batch spec): configs leave them out, and a saved config's are
# ignored, so states saved with them still resume exactly.
NOT_ORDER = ("boundary", "provenance")


def saved_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as states save it: fields at their ``ABSENT_MEANS`` value and ``NOT_ORDER``
    fields left out."""
    return {k: v for k, v in config.items()
            if k not in NOT_ORDER and (k not in ABSENT_MEANS or v != ABSENT_MEANS[k])}


def order_config(config: dict[str, Any]) -> dict[str, Any]:
    """A saved config without the fields that never change the order (``NOT_ORDER``)."""
    return {k: v for k, v in config.items() if k not in NOT_ORDER}


def config_fingerprint(config: dict[str, Any]) -> str:
    """The fingerprint of a saved config, as this streamforge computes it (``NOT_ORDER`` fields
    left out): what a loader's own fingerprint is compared with."""
    return fingerprint(order_config(config))


def config_value(config: dict[str, Any], key: str, default: Any = None) -> Any:
    """A saved config's ``key``; a missing one means its ``ABSENT_MEANS`` value, else ``default``."""
    return config.get(key, ABSENT_MEANS.get(key, default))


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two loader configs, one line per field."""
    out = []
    for key in sorted((set(saved) | set(current)) - set(NOT_ORDER)):
        a, b = config_value(saved, key), config_value(current, key)
        if key == "streams" and isinstance(a, list) and isinstance(b, list):
            out.extend(_stream_differences(a, b))
        elif a != b:
            out.append(f"{key}: saved {a!r}, now {b!r}")
    return out


def _stream_differences(saved: list[dict], current: list[dict]) -> list[str]:
    out = []
    by_name = {s["name"]: s for s in current}
    for s in saved:
        now = by_name.get(s["name"])
        if now is None:
            out.append(f"stream {s['name']!r}: in the saved state, not in this loader")
            continue
        if s["manifest"] != now["manifest"]:
            out.append(f"stream {s['name']!r}: corpus changed (manifest {s['manifest']} -> {now['manifest']})")
        if s["weight"] != now["weight"]:
            out.append(f"stream {s['name']!r}: weight {s['weight']} -> {now['weight']}")
        for key, default in (("repeat", 1.0), ("upsample", False)):  # readings per pass (planning/readings.py)
            if s.get(key, default) != now.get(key, default):
                out.append(f"stream {s['name']!r}: {key} {s.get(key, default)} -> {now.get(key, default)}")
    saved_names = {s["name"] for s in saved}
    for s in current:
        if s["name"] not in saved_names:
            out.append(f"stream {s['name']!r}: new in this loader")
    if [s["name"] for s in saved] != [s["name"] for s in current] and not out:
        out.append("stream order changed")
    return out


@dataclass
class ResumeReport:
    """What ``load_state_dict`` did (``StreamingLoader.resume_report``).

    Args:
        mode: ``"exact"``, ``"elastic"`` or ``"statistical"``.
        summary: one sentence on how the job goes on.
        differences: what differs between the saved job and this one, one line each.
        approximations: what the resume could not keep exactly, with bounds.
        skipped: the damaged records the saved job skipped.
    """

    mode: str
    summary: str
    differences: list[str] = field(default_factory=list)
    approximations: list[str] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"resume: {self.mode}: {self.summary}"]
        lines += [f"  changed: {d}" for d in self.differences]
        lines += [f"  approximated: {a}" for a in self.approximations]
        lines += [
            f"  skipped damaged records: stream {s.get('stream')} shard {s.get('shard')} "
            f"records {s.get('start')}..{s.get('stop')} ({s.get('reason')})"
            for s in self.skipped
        ]
        return "\n".join(lines)

    @property
    def exact(self) -> bool:
        return self.mode == "exact"
