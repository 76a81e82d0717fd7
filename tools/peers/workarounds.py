"""What the peers need to run here at all, confined to the benchmark's own processes: a stand-in
torchvision for MosaicML Streaming, and the check that LitData can read its zstd chunks from S3."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import json
import os
import sys
import types


def install_torchvision_stub() -> None:
    """mosaicml-streaming imports torchvision at import time (``streaming.vision``), and the
    registry's torchvision wheel does not load with this torch (``operator torchvision::nms
    does not exist``). Text datasets never use it: give this process a stand-in module."""
    if "torchvision" in sys.modules:
        return
    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")

    class VisionDataset:  # never instantiated by a text dataset
        def __init__(self, *args, **kwargs):
            raise RuntimeError("torchvision is stubbed out in this benchmark")

    def _missing(*args, **kwargs):
        raise RuntimeError("torchvision is stubbed out in this benchmark")

    datasets.VisionDataset = VisionDataset
    datasets.CIFAR10 = datasets.ImageFolder = VisionDataset
    functional.to_tensor = _missing
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional
    tv.__version__ = "0.0.0+stub"
    for module in (tv, datasets, transforms, functional):  # find_spec() looks at these
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    sys.modules.update({"torchvision": tv, "torchvision.datasets": datasets,
                        "torchvision.transforms": transforms, "torchvision.transforms.functional": functional})


LITDATA_ZSTD_REMOTE = (
    "LitData {version}: `optimize(compression='zstd')` with `TokensLoader` wrote `{written}` but its index.json "
    "names `{indexed}`; a remote reader waits for that object (ChunkWaitTimeoutError after 120 s), and served "
    "under the indexed name the chunk does not decompress (ZstdError: Unknown frame descriptor). Local reads "
    "find the written file."
)


def litdata_index_mismatch(local: str) -> str | None:
    """Why LitData cannot read this chunk directory from object storage, or None."""
    path = os.path.join(local, "index.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        index = json.load(f)
    for chunk in index.get("chunks", []):
        name = chunk.get("filename", "")
        plain = name.replace(".zstd.bin", ".bin")
        if name != plain and not os.path.exists(os.path.join(local, name)) and os.path.exists(os.path.join(local, plain)):
            return LITDATA_ZSTD_REMOTE.format(version=importlib.metadata.version("litdata"), written=plain,
                                              indexed=name)
    return None
