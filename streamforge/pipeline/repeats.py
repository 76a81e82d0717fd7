"""A dataset's readings per pass: ``Stream(repeat=k)`` as given, ``upsample=True`` computed
(``planning/readings.py``), checked against the dataset's other settings and described into
its configuration (so the resume fingerprint and the ledger's meta hold them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from ..planning.readings import upsample_repeats
from ..planning.steps import JobTokens


def check_readings(dataset) -> None:
    """``repeat``/``upsample`` where they mean something, else ``ConfigError``."""
    for s in dataset.streams:
        if dataset.evaluation and (s.repeat != 1 or s.upsample):
            raise ConfigError(f"stream {s.name!r}: an evaluation dataset reads every held-out token once; "
                              "repeat= and upsample= do not apply")
        if s.upsample and dataset.config.infinite:
            raise ConfigError(f"stream {s.name!r}: upsample=True fills a finite pass; with infinite=True every "
                              "stream runs its passes on its own and its weights hold without it")


def stream_tokens(dataset) -> list[int]:
    """Each stream's tokens in one reading, EOS appended by the pipeline included."""
    out = []
    for m, eos in zip(dataset.manifests, dataset.eos_appended):
        docs = m.columns.get("num_docs", m.columns["num_records"])
        out.append(int(m.num_tokens) + (int(np.sum(docs)) if eos else 0))
    return out


def resolve_repeats(dataset, job: JobTokens) -> list[float]:
    """The readings per pass of each stream, for passes whose steps hold ``job``'s tokens."""
    streams = dataset.streams
    if not any(s.upsample for s in streams):
        return [s.repeat for s in streams]
    schedule = dataset.schedule
    return upsample_repeats(
        dataset.stream_names, stream_tokens(dataset), [s.repeat for s in streams], [s.upsample for s in streams],
        schedule.starts, schedule.weights, job,
    )


def describe_readings(stream, manifest, repeat: float) -> dict[str, Any]:
    """A stream's readings for the loader config: nothing for a stream read once."""
    if repeat == 1 and not stream.upsample:
        return {}
    out: dict[str, Any] = {"repeat": repeat, "shards": manifest.num_shards}
    if stream.upsample:
        out["upsample"] = True
    return out
