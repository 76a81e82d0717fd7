"""The fixed figures of the comparison: the corpus, the block and batch every system delivers,
the systems and ceilings, and the names the report gives them."""

from __future__ import annotations

import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
TOOLS = os.path.join(ROOT, "tools")
ENTRY = os.path.join(TOOLS, "bench_peers.py")  # what a case's fresh process runs (``--child``)

VOCAB = 50257
EOS = 50256
SEQ_LEN = 2048
BLOCK = SEQ_LEN + 1  # the peers' block: 2048 inputs and the next token
BATCH = 8
SHARD_MIB = 16
POSITIONS = (0.1, 0.5, 0.9)
M = 1e6
SYSTEMS = ("streamforge", "grain", "litdata-zstd", "litdata-raw", "mosaic", "webdataset")
CEILINGS = ("memmap", "contract", "zstd")
# streamforge at equal output and WebDataset's settings, for the memory comparison: the two
# tensors a peer's block stands for (input_ids and labels, where the peers hand out one int64
# block per row), a shuffle of about as many tokens as WebDataset's 1000-block sample buffer
# (2048 documents of ~990 tokens against 1000 x 2049) and no read-ahead: WebDataset reads each
# tar in the iterating thread through its file opener's 8 KiB buffer (``gopen``'s default
# ``bufsize``), with nothing fetched ahead; local disk, 0 workers only
EQUAL = "streamforge-equal"
EQUAL_SHUFFLE, EQUAL_READ_AHEAD = 2048, 0
EQUAL_FIELDS = ("input_ids", "labels")
# storage: local disk, loopback S3 (moto behind a counting proxy that adds nothing) and the same
# S3 behind a proxy that adds a time to first byte and caps each connection's bandwidth
BACKENDS = ("local", "s3", "s3-latency")
LATENCY_MS, BANDWIDTH_MBPS = 25.0, 100.0
NAMES = {
    "streamforge": "streamforge",
    EQUAL: "streamforge, input_ids + labels, at WebDataset's settings",
    "grain": "Grain (ArrayRecord), as torchtitan builds it",
    "litdata-zstd": "LitData, zstd chunks",
    "litdata-raw": "LitData, uncompressed chunks",
    "mosaic": "MosaicML Streaming (MDS)",
    "webdataset": "WebDataset + torchdata StatefulDataLoader",
    "memmap": "ceiling: packing a flat np.memmap",
    "contract": "ceiling: the full batch contract from a flat np.memmap",
    "zstd": "ceiling: raw zstd decoding of the shards",
}
PACKAGES = {"streamforge": None, "grain": "grain", "litdata-zstd": "litdata", "litdata-raw": "litdata",
            "mosaic": "mosaicml-streaming", "webdataset": "webdataset"}
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "peers"
PEERS = tuple(s for s in SYSTEMS if s != "streamforge")


def storage_name(backend: str, latency_ms: float = LATENCY_MS, bandwidth_mbps: float = BANDWIDTH_MBPS) -> str:
    if backend == "local":
        return "local disk"
    if backend == "s3":
        return "loopback S3"
    return f"S3, {latency_ms:g} ms + {bandwidth_mbps:g} MB/s"
