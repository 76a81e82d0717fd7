"""Readings: a stream read more than once per pass (``Stream(repeat=k)`` or ``upsample=True``).

A stream with ``repeat=k`` is read ``ceil(k)`` times in each pass: readings ``0..ceil(k)-1``,
the last one partial when ``k`` is fractional (the first ``k - floor(k)`` of that reading's
order, in tokens). Each reading is planned like a pass of its own (``plan.plan_stream``):
its own shard order, keyed by (seed, stream, pass, reading) (reading 0 keeps the key of an
unrepeated stream), cut at its own token quantiles; global worker ``g`` reads the piece
``(g + r) % N`` of reading ``r``, so a worker meets other records in each reading, and reads
its readings one after the other.

Everything downstream sees a repeated stream as a stream of ``ceil(k)`` times its shards:
reading ``r`` of shard ``s`` is shard ``r * S + s`` of the stream's *reading manifest*
(``reading_manifest``: the shard table tiled, the same files), so cursors, shuffle windows,
elastic and statistical resume, provenance and the ledger carry the reading in the shard id
with no change: exactly-once means once per (reading, shard, record). ``split_shard`` turns
such an id back into (reading, shard).

``upsample=True`` computes ``k`` from the plan: the stream's tokens against what its weights
ask of the pass (``upsample_repeats``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from ..errors import ConfigError
from ..format.manifest import Manifest
from .plan import Range, cut_shards, plan_stream
from .steps import JobTokens

MAX_REPEAT = 10_000  # readings of one stream in a pass, at most


def count(repeat: float) -> int:
    """The readings of a pass: ``ceil(repeat)``."""
    return max(1, math.ceil(repeat - 1e-12))


def fractions(repeat: float) -> list[float]:
    """The part of each reading a pass reads: 1.0 for every reading but a partial last one."""
    n = count(repeat)
    return [1.0] * (n - 1) + [min(1.0, repeat - (n - 1))]


def reading_key(stream_key: str, reading: int) -> str:
    """The key of a reading's shard order (reading 0: the stream's own)."""
    return stream_key if reading == 0 else f"{stream_key}#reading{reading}"


def reading_manifest(manifest: Manifest, repeat: float) -> Manifest:
    """The manifest the pipeline reads a stream of ``repeat`` through: its shard table
    ``count(repeat)`` times over (the same files; ``split_shard`` maps the ids back)."""
    n = count(repeat)
    if n == 1:
        return manifest
    return dataclasses.replace(
        manifest, shard_names=list(manifest.shard_names) * n, shard_sha256=list(manifest.shard_sha256) * n,
        columns={k: np.tile(v, n) for k, v in manifest.columns.items()},
    )


def split_shard(shard, num_shards: int):
    """(reading, shard) of a reading manifest's shard id(s)."""
    return shard // num_shards, shard % num_shards


def plan_readings(
    shard_records, shard_tokens, *, repeat: float, seed: int, stream_key: str, pass_idx: int,
    num_global_workers: int, record_tokens: Callable[[int], np.ndarray] | None = None,
    workers: Sequence[int] | None = None,
) -> list[list[Range]]:
    """``plan.plan_stream`` for a stream read ``repeat`` times: each global worker's ranges
    of every reading, reading after reading, in reading-manifest shard ids."""
    n = num_global_workers
    num_shards = len(shard_records)
    wanted = list(range(n)) if workers is None else list(workers)
    out: list[list[Range]] = [[] for _ in wanted]
    for r, fraction in enumerate(fractions(repeat)):
        pieces = plan_stream(shard_records, shard_tokens, seed=seed, stream_key=reading_key(stream_key, r),
                             pass_idx=pass_idx, num_global_workers=n, record_tokens=record_tokens,
                             workers=[(g + r) % n for g in wanted], fraction=fraction)
        offset = r * num_shards
        for ranges, piece in zip(out, pieces):
            ranges += [(offset + shard, a, b) for shard, a, b in piece]
    return out


def reading_cut_shards(shard_records, shard_tokens, *, repeat: float, seed: int, stream_key: str, pass_idx: int,
                       num_global_workers: int, workers: Sequence[int] | None = None) -> set[int]:
    """The (physical) shards the cuts of every reading fall inside (``plan.cut_shards``)."""
    n = num_global_workers
    out: set[int] = set()
    for r, fraction in enumerate(fractions(repeat)):
        mine = None if workers is None else [(g + r) % n for g in workers]
        out |= cut_shards(shard_records, shard_tokens, seed=seed, stream_key=reading_key(stream_key, r),
                          pass_idx=pass_idx, num_global_workers=n, workers=mine, fraction=fraction)
    return out


def check_repeat(name: str, repeat, upsample) -> float:
    """A stream's ``repeat`` as a float, refused with ``ConfigError`` naming the stream."""
    if isinstance(repeat, bool) or not isinstance(repeat, (int, float)) or not math.isfinite(repeat) \
            or not 0 < repeat <= MAX_REPEAT:
        raise ConfigError(f"stream {name!r}: repeat must be a number > 0 and <= {MAX_REPEAT}, got {repeat!r}")
    if not isinstance(upsample, bool):
        raise ConfigError(f"stream {name!r}: upsample must be True or False, got {upsample!r}")
    if upsample and repeat != 1:
        raise ConfigError(f"stream {name!r}: give repeat= or upsample=True, not both (upsample computes the repeat)")
    return float(repeat)


def upsample_repeats(names: Sequence[str], tokens: Sequence[int], repeats: Sequence[float],
                     upsample: Sequence[bool], starts: Sequence[int], weights: Sequence[Sequence[float]],
                     job: JobTokens) -> list[float]:
    """Each stream's repeat, the ``upsample`` ones computed: as many readings as the weights
    ask of the pass, at least one.

    The pass lasts ``P`` tokens: what the streams hold, ``sum(repeat_j * tokens_j)``. An
    upsampled stream ``u`` must give ``D_u(P)``: its weight times the tokens of each phase
    inside the pass (phases are steps, ``job`` the tokens they hold: with a batch-size or
    sequence-length schedule a step's tokens change with it). So ``P`` solves ``P = F +
    sum_u max(tokens_u, D_u(P))`` with ``F`` the other streams' tokens: ``P - sum_u D_u(P)``
    grows with ``P`` while the upsampled streams do not hold all the weight, and bisection
    finds ``P``; then ``repeat_u = D_u(P) / tokens_u``, at least 1. Rounded to 1e-6."""
    ups = [i for i, u in enumerate(upsample) if u]
    out = [float(r) for r in repeats]
    if not ups:
        return out
    fixed = sum(r * t for i, (r, t) in enumerate(zip(repeats, tokens)) if not upsample[i])
    empty = [names[i] for i in ups if tokens[i] <= 0]
    if empty:
        raise ConfigError(f"stream {empty[0]!r}: upsample=True on a stream without tokens")

    def demand(u: int, total: float) -> float:
        steps, got = job.step_at(total), 0.0
        for p, start in enumerate(starts):
            end = starts[p + 1] if p + 1 < len(starts) else math.inf
            if start < steps:
                got += weights[p][u] * (job.until(min(end, steps)) - job.until(start))
        return got

    def excess(total: float) -> float:
        return total - fixed - sum(max(tokens[u], demand(u, total)) for u in ups)

    last = weights[-1]
    if sum(last[u] for u in ups) >= 1 - 1e-12:
        hold = [names[u] for u in ups if last[u] > 0]
        raise ConfigError(f"upsample: from step {starts[-1]} the upsampled stream(s) {hold} hold all the weight, so "
                          "a finite pass would never end; give them repeat= instead")
    lo, hi = 0.0, max(1.0, fixed + sum(tokens[u] for u in ups))
    while excess(hi) < 0:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    for u in ups:
        out[u] = round(max(1.0, demand(u, hi) / tokens[u]), 6)
        if out[u] > MAX_REPEAT:
            raise ConfigError(f"stream {names[u]!r}: upsample needs {out[u]:.0f} readings per pass, more than "
                              f"{MAX_REPEAT}")
    return out
