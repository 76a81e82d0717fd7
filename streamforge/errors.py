"""Every exception streamforge raises.

One base class, and a few subclasses a caller can act on. Each also derives from the builtin
that fits, so ``except ValueError`` / ``except OSError`` code keeps working.
"""

from __future__ import annotations


class StreamforgeError(Exception):
    """Base class of all streamforge errors."""


class ConfigError(StreamforgeError, ValueError):
    """A constructor argument or a combination of arguments is invalid."""


class SourceError(StreamforgeError, ValueError):
    """A conversion source (Megatron .bin/.idx, flat .bin, .npy, jsonl...) is malformed."""


class ManifestError(StreamforgeError, ValueError):
    """A stream's manifest is missing, malformed, or of another format version."""


class ShardCorruptError(StreamforgeError, OSError):
    """A shard's bytes do not match its manifest or do not decode."""


class StorageError(StreamforgeError, OSError):
    """A storage operation failed after all retries (names url, shard, frame and record)."""


class ResumeMismatchError(StreamforgeError, ValueError):
    """A saved loader state cannot be applied to this loader."""


class LedgerError(StreamforgeError, ValueError):
    """A data-order ledger is missing, unreadable, or its options are invalid."""


class PipelineInvariantError(StreamforgeError, RuntimeError):
    """streamforge broke one of its own invariants (a worker's step or share of a pass is not
    the one the plan gives it): a bug to report, not something a caller can fix."""


class MixtureWarning(UserWarning):
    """A finite pass cannot honour the mixture's weights: a stream runs out early and nothing
    repeats it (``stats()["mixture"]`` holds the same estimate)."""


class DropWarning(UserWarning):
    """A finite pass with record cuts drops more than 1% of its tokens: what heavier workers
    hold past the steps the lightest one fills (``stats()["pass_dropped_share"]``); the fix
    is ``cuts="tokens"``."""
