"""Loader state: version, fingerprint, and what a resume did.

The loader's state is plain data::

    {"version": 2, "fingerprint": "...", "config": {...},
     "rank": r, "world_size": R, "workers_per_rank": W,
     "step": s, "pass": p, "pass_first_step": s0, "batch": i, "pass_tokens": t,
     "workers": [pipeline state or None, ...], "skip_steps": [[a, b], ...],
     "counters": {...}, "skipped": [...]}

``step`` is the global step of the next batch; ``batch`` the rank's next local batch in the
pass (``step = pass_first_step + batch``), which comes from worker ``batch % W``.

``config`` holds every value exactness depends on (stream names, weights and manifest
fingerprints; seed; world size R; workers per rank W; seq_len; packing; boundary; shuffle
buffer; batch size...), so a mismatch can be named, not just detected. The fingerprint is a
digest of ``config``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

STATE_VERSION = 2
STATE_KEYS = (
    "version", "fingerprint", "config", "rank", "world_size", "workers_per_rank", "step", "pass",
    "pass_first_step", "batch", "pass_tokens", "workers", "skip_steps", "counters",
)
MODES = ("exact", "elastic", "statistical")


def fingerprint(config: dict[str, Any]) -> str:
    blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two loader configs, one line per field."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
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
    saved_names = {s["name"] for s in saved}
    for s in current:
        if s["name"] not in saved_names:
            out.append(f"stream {s['name']!r}: new in this loader")
    if [s["name"] for s in saved] != [s["name"] for s in current] and not out:
        out.append("stream order changed")
    return out


@dataclass
class ResumeReport:
    """What ``load_state_dict`` did: ``mode`` is "exact", "elastic" or "statistical"."""

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
