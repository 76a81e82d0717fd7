"""streamforge: stream packed token blocks from sharded tar/zstd corpora on object storage."""

from .errors import (
    ConfigError,
    DropWarning,
    LedgerError,
    ManifestError,
    MixtureWarning,
    ResumeMismatchError,
    ShardCorruptError,
    SourceError,
    StorageError,
    StreamforgeError,
)
from .format.manifest import Manifest, ShardInfo
from .format.writer import ShardWriter
from .source import read_records
from .pipeline.dataset import EvaluationDataset, PackedTokenDataset, PackingConfig, ShuffleConfig, Stream
from .loader.loader import StreamingLoader
from .ledger.attach import LedgerConfig
from .ledger.store import read_ledger
from .pipeline.metrics import StreamLoss
from .pipeline.cost import AttentionCost
from .planning.schedule import Phase
from .pipeline.masks import cu_seqlens, document_block_mask, packed_causal_mask
from .resume.state import ResumeReport, merge_states, unpack_state
from .storage.config import HedgePolicy, RetryPolicy, StorageConfig

__version__ = "0.1.0"

__all__ = sorted(
    [
        "AttentionCost",
        "ConfigError",
        "DropWarning",
        "LedgerError",
        "Manifest",
        "ManifestError",
        "MixtureWarning",
        "ResumeMismatchError",
        "ShardCorruptError",
        "ShardInfo",
        "ShardWriter",
        "SourceError",
        "StorageError",
        "StreamforgeError",
        "read_ledger",
        "EvaluationDataset",
        "LedgerConfig",
        "PackingConfig",
        "ShuffleConfig",
        "read_records",
        "PackedTokenDataset",
        "Phase",
        "ResumeReport",
        "Stream",
        "StreamingLoader",
        "StreamLoss",
        "cu_seqlens",
        "merge_states",
        "unpack_state",
        "document_block_mask",
        "packed_causal_mask",
        "HedgePolicy",
        "RetryPolicy",
        "StorageConfig",
    ]
)
