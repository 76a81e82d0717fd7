"""The dataset's settings: streams, the pipeline's configuration, shuffle and packing."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import ConfigError
from ..format.manifest import Manifest
from ..planning.steps import StepSchedule
from ..planning.readings import check_repeat
from ..stages.pack import MODES

BOUNDARIES = ("document", "stream")
PACKINGS = MODES + ("balance",)  # balance: stages/balance.py


@dataclass
class Stream:
    """One source of documents: a stream URL, its mixing weight and a stable name.

    The name (default: ``stream<i>``, its position) keys seeds and state; the URL never
    does, so the same corpus copied elsewhere gives the same batches.

    Args:
        url: the stream's prefix (any fsspec URL holding its ``index.json``).
        weight: its share of the mixture's tokens, before any schedule.
        name: the stable name; None takes ``stream<i>``.
        storage_options: passed to the stream's filesystem (credentials, endpoint...);
            never printed.
        repeat: readings of the stream per pass (> 0; a fraction reads the first part of a
            last reading), each in its own order (docs/mixing.md, upsampling).
        upsample: in a finite pass, as many readings as the stream's weights need until the
            pass ends (computed from the plan; not together with ``repeat``).
    """

    url: str
    weight: float = 1.0
    name: str | None = None
    storage_options: dict[str, Any] | None = None
    repeat: float = 1.0
    upsample: bool = False

    def __repr__(self) -> str:  # storage options hold keys and tokens: never printed
        options = None if self.storage_options is None else _masked(self.storage_options)
        extra = (f", repeat={self.repeat!r}" if self.repeat != 1 else "") + (", upsample=True" if self.upsample else "")
        return (f"Stream(url={self.url!r}, weight={self.weight!r}, name={self.name!r}, "
                f"storage_options={options!r}{extra})")


_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "auth", "session", "signature")


def _masked(options: Any) -> Any:
    """``options`` with the value of every key that names a secret replaced by ``'***'``."""
    if isinstance(options, dict):
        return {k: "***" if any(w in str(k).lower() for w in _SECRET_WORDS) and v is not None and not isinstance(
            v, (dict, list, bool)) else _masked(v) for k, v in options.items()}
    if isinstance(options, list):
        return [_masked(v) for v in options]
    return options


@dataclass(frozen=True)
class PipelineConfig:
    seq_len: int
    seed: int
    shuffle_buffer: int
    shuffle_warmup: int
    packing: str
    boundary: str
    eos_id: int | None
    pad_id: int
    infinite: bool
    provenance: bool
    bestfit_window: int
    cuts: str = "records"  # where the plan cuts a stream: record boundaries or token positions

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ConfigError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.shuffle_buffer < 1:
            raise ConfigError(f"shuffle_buffer must be >= 1 document, got {self.shuffle_buffer}")
        if self.shuffle_warmup < 0:
            raise ConfigError(f"shuffle_warmup must be >= 0 documents (0: no warm-up), got {self.shuffle_warmup}")
        if self.packing not in PACKINGS:
            raise ConfigError(f"packing must be one of {PACKINGS}, got {self.packing!r}")
        if self.boundary not in BOUNDARIES:
            raise ConfigError(f"boundary must be one of {BOUNDARIES}, got {self.boundary!r}")
        if self.bestfit_window < 1:
            raise ConfigError(f"bestfit_window must be >= 1, got {self.bestfit_window}")


def scheduled(name: str, value: Any) -> StepSchedule:
    """``value`` as a ``StepSchedule``: an int (checked by ``whole``) or ``[(step, value),
    ...]`` (checked by ``StepSchedule.build``); ``ConfigError`` naming what is wrong."""
    if isinstance(value, (list, tuple, StepSchedule)):
        return StepSchedule.build(name, value)
    return StepSchedule.build(name, whole(name, value, 1))


def whole(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, refused with ``ConfigError`` unless it is a whole number (not a
    bool, a float or a string, so ``1.5`` never becomes ``1`` silently) and at least
    ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _refuse_empty_streams(streams: Sequence[Stream], manifests: Sequence[Manifest]) -> None:
    """An infinite pipeline over a stream without a document would re-plan its passes
    forever, finding nothing: refuse it up front, naming the stream."""
    for s, m in zip(streams, manifests):
        docs = m.columns.get("num_docs")
        if m.num_tokens == 0 or (docs is not None and int(docs.sum()) == 0):
            raise ConfigError(
                f"stream {s.name!r} ({s.url}) has no document with a token ({m.num_shards} shard(s), "
                f"{m.num_records} record(s), {m.num_tokens} tokens): an infinite pass over it would never "
                "end; drop the stream or use infinite=False"
            )


def _normalize_streams(streams: Any, scheduled: bool = False) -> list[Stream]:
    if isinstance(streams, (str, os.PathLike, Stream)):
        streams = [streams]
    out = [s if isinstance(s, Stream) else Stream(str(s)) for s in streams]
    if not out:
        raise ConfigError("at least one stream is needed")
    names = [s.name or f"stream{i}" for i, s in enumerate(out)]
    if len(set(names)) != len(names):
        raise ConfigError(f"stream names must be unique, got {names}")
    seen: dict[str, str] = {}
    for s, name in zip(out, names):
        url = str(s.url).rstrip("/")
        if url in seen:
            warnings.warn(f"streamforge: streams {seen[url]!r} and {name!r} read the same URL {url}: its documents "
                          "come twice per pass, once under each name", stacklevel=3)
        seen.setdefault(url, name)
    for s in out:
        if not s.weight >= 0:
            raise ConfigError(f"stream {s.name or s.url}: weight must be >= 0, got {s.weight}")
    if sum(s.weight for s in out) <= 0 and not scheduled:
        raise ConfigError("at least one stream needs a positive weight")
    return [Stream(str(s.url), float(s.weight), n, s.storage_options, check_repeat(n, s.repeat, s.upsample),
                   s.upsample) for s, n in zip(out, names)]


@dataclass(frozen=True)
class ShuffleConfig:
    """How each stream's documents are shuffled (docs/design.md, the shuffle windows).

    Args:
        buffer: documents in a full shuffle window.
        warmup: documents in a pass's first window, doubling up to ``buffer`` (0: full
            windows from the start).
    """

    buffer: int = 8192
    warmup: int = 256


@dataclass(frozen=True)
class PackingConfig:
    """How documents are packed into rows (docs/batch.md).

    Args:
        mode: ``"concat"`` (documents end to end, cut at row ends), ``"pad"`` (whole
            documents, each row padded), ``"bestfit"`` (whole documents, best fit) or
            ``"balance"`` (rows of equal attention cost; ``stages/balance.py``).
        bestfit_window: the documents ``"bestfit"`` chooses among.
    """

    mode: str = "concat"
    bestfit_window: int = 512


_SHUFFLE, _PACKING = ShuffleConfig(), PackingConfig()


def _settings(shuffle: ShuffleConfig | None, packing: str | PackingConfig, shuffle_buffer: int,
              shuffle_warmup: int, bestfit_window: int) -> tuple[ShuffleConfig, PackingConfig]:
    """The shuffle and packing settings from either their objects or the older keywords."""
    if shuffle is None:
        shuffle = ShuffleConfig(shuffle_buffer, shuffle_warmup)
    elif (shuffle_buffer, shuffle_warmup) != (_SHUFFLE.buffer, _SHUFFLE.warmup):
        raise ConfigError("pass the shuffle settings once: shuffle=ShuffleConfig(...) or shuffle_buffer=/"
                          "shuffle_warmup=, not both")
    if isinstance(packing, PackingConfig):
        if bestfit_window != _PACKING.bestfit_window:
            raise ConfigError("pass the packing settings once: packing=PackingConfig(...) or bestfit_window=, "
                              "not both")
        return shuffle, packing
    return shuffle, PackingConfig(packing, bestfit_window)
