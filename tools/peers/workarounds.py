"""What the peers need to run here at all, confined to the benchmark's own processes: the check
that LitData can read its zstd chunks from S3;
``NOTES``, the report's list of every workaround (the code of the others is beside the loader
it serves, in ``loaders.py`` and ``loaders_grain.py``)."""

from __future__ import annotations

import importlib.metadata
import json
import os


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


NOTES = (
    "**MosaicML Streaming** imports torchvision when it is imported (`streaming.vision`), and the "
    "registry's torchvision 0.28.0 does not load beside the CPU build of torch 2.13.0 that the library's "
    "own environments pin (`RuntimeError: operator torchvision::nms does not exist`). The peers' venv "
    "(`make venv-bench`, `constraints-bench.txt`) therefore pins torch 2.14.1 with torchvision 0.29.1, a "
    "pair that loads together, and every system, streamforge included, runs on that torch. "
    "mosaicml-streaming also pins `google-cloud-storage<3.3`, below what gcsfs (a test extra) needs, "
    "another reason the peers live in their own venv.",
    "**LitData** downloads chunks with obstore, which refuses `http://` endpoints unless its client "
    "options say `allow_http`; LitData passes fixed client options (so obstore's `AWS_ALLOW_HTTP` "
    "variable is not read) and has no setting for it, so the LitData processes add `allow_http` to "
    "`litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS` when the endpoint is plain http. The endpoint "
    "(the proxy's) and keys go in `storage_options`; chunks are cached in a fresh directory per run, removed "
    "after it.",
    "**WebDataset** reads http URLs through `curl` (its `gopen`); moto refuses anonymous GETs, so the "
    "shard URLs are presigned (boto3, against the proxy's endpoint, whose host the signature covers and "
    "the proxy passes on unchanged) when the loader is built. Its shard list is kept beside the shards "
    "(`shards.json`), WebDataset having no index.",
    "**MosaicML Streaming** from S3 copies each shard into a local cache directory (fresh per run) and "
    "reads it there; `S3_ENDPOINT_URL` names the endpoint (the proxy's).",
    "**Grain** reads ArrayRecord files by local path only (array_record's C++ reader opens them on the "
    "local file system), so its S3 cells are reported as not runnable; nothing is mounted or copied for "
    "it. Its pipeline hands out NumPy arrays: a `map` after `batch` casts the uint16 rows to int64, as the "
    "other peers' collate functions do, and the adapter (`GrainLoader`) wraps them in tensors without a "
    "copy and passes the live iterator's `get_state()`/`set_state()` as `state_dict`/`load_state_dict`.",
)
