"""streamforge next to the loaders users would otherwise pick, on one synthetic corpus.

    python tools/bench_peers.py [--tokens 50e6 500e6] [--repeats 3] [--systems ...]
                                [--large-systems ...] [--workers 0 2] [--backends local s3]
                                [--no-growth] [--no-write]

Needs the ``bench`` extra (``make venv-bench``: LitData, MosaicML Streaming, WebDataset,
torchdata, psutil, moto); a peer that is not installed or does not run is reported with the
reason, never dropped.

1. Corpus (per ``--tokens`` size, built once under ``bench-out/peers/``): lognormal document
   lengths (median 600, sigma 1.0), ids ``zipf(1.3) % 50256``, each document followed by EOS
   50256, as one flat uint16 file; then each system writes it in its own format with its own
   writer, 16 MiB shards/chunks: streamforge (``ShardWriter``, tar/zstd), LitData
   (``litdata.optimize`` with ``TokensLoader``, zstd and uncompressed), MosaicML Streaming
   (``MDSWriter``, one sample per 2049-token block) and WebDataset (``wds.ShardWriter``, one
   sample per 2049-token block).
2. The job: one pass of packed 2049-token int64 blocks in batches of 8. streamforge hands out
   its full batch contract (``seq_len=2048``: input_ids, labels, position_ids, doc_ids,
   source_ids); the peers hand out bare ``[8, 2049]`` int64 token blocks. Every system
   shuffles with its own mechanism, seeded.
3. Each case runs in a fresh process (``--child``) and reports tokens/s (corpus tokens
   delivered over the seconds from building the loader to the end of the pass), time to
   first batch, CPU-seconds of the process tree (user + sys, the case process and its
   workers, the S3 server excluded) and peak RSS summed over the tree (sampled every 50 ms
   by this process with psutil), with 0 and 2 workers, from local disk and from a moto S3
   server this tool starts on 127.0.0.1 (and stops, by its pid). Three ceilings run from local
   disk: packing the flat ``np.memmap`` into the same blocks, building streamforge's full
   batch contract (all five tensors) from it in file order, and raw zstd decoding of
   streamforge's shards.
4. Resume, with each system's own mechanism (streamforge ``state_dict``; LitData's and
   Mosaic's ``StreamingDataLoader`` state; WebDataset through torchdata's
   ``StatefulDataLoader``): states saved at 10%, 50%, 90% of an uninterrupted pass; a fresh
   process builds the loader, loads the state and takes the first batch (timed), then checks
   the next ``--resume-check`` batches against the uninterrupted pass's.
5. streamforge alone, how the cost grows (``growth``): tokens/s and RSS against shard size,
   number of streams and shuffle buffer; time to first batch against shards in the manifest.

The smallest ``--tokens`` size is the main table, with resume and the targets; each larger
size (10x: start-up against steady state) measures ``--large-systems`` only (default: all),
and a system left out there is named with its pass time at the main size. Medians of
``--repeats`` runs with min-max; ratios to streamforge. The ``peers`` and
``growth`` sections of docs/benchmarks.md and docs/img/peers_*.png, growth.png are rewritten.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import pickle
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
TOOLS = os.path.join(ROOT, "tools")
sys.path.insert(0, ROOT)
sys.path.insert(0, TOOLS)

import numpy as np  # noqa: E402

from _benchdoc import spread  # noqa: E402

VOCAB = 50257
EOS = 50256
SEQ_LEN = 2048
BLOCK = SEQ_LEN + 1  # the peers' block: 2048 inputs and the next token
BATCH = 8
SHARD_MIB = 16
POSITIONS = (0.1, 0.5, 0.9)
M = 1e6
SYSTEMS = ("streamforge", "litdata-zstd", "litdata-raw", "mosaic", "webdataset")
CEILINGS = ("memmap", "contract", "zstd")
# streamforge at WebDataset's settings, for the memory comparison: a shuffle of about as many
# tokens as WebDataset's 1000-block sample buffer (2048 documents of ~990 tokens against
# 1000 x 2049) and a 4 MiB read-ahead; local disk, 0 workers only
EQUAL = "streamforge-equal"
EQUAL_SHUFFLE, EQUAL_READ_AHEAD = 2048, 4 << 20
NAMES = {
    "streamforge": "streamforge",
    EQUAL: "streamforge at WebDataset's settings",
    "litdata-zstd": "LitData, zstd chunks",
    "litdata-raw": "LitData, uncompressed chunks",
    "mosaic": "MosaicML Streaming (MDS)",
    "webdataset": "WebDataset + torchdata StatefulDataLoader",
    "memmap": "ceiling: packing a flat np.memmap",
    "contract": "ceiling: the full batch contract from a flat np.memmap",
    "zstd": "ceiling: raw zstd decoding of the shards",
}
PACKAGES = {"streamforge": None, "litdata-zstd": "litdata", "litdata-raw": "litdata",
            "mosaic": "mosaicml-streaming", "webdataset": "webdataset"}
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "peers"


# ================================================================================================
# corpus
# ================================================================================================
def corpus_params(num_tokens: int) -> dict:
    return {"layout": 1, "tokens": num_tokens, "seed": 0, "median": 600, "sigma": 1.0, "zipf": 1.3,
            "vocab": VOCAB, "eos_id": EOS}


def ensure_flat(root: str, num_tokens: int) -> dict:
    """The documents, each followed by EOS, as one flat uint16 file (and their start offsets)."""
    from _benchdoc import cached_meta

    params = corpus_params(num_tokens)
    meta = cached_meta(root, params)
    if meta is not None:
        return meta
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    rng = np.random.default_rng(params["seed"])
    flat, starts = os.path.join(root, "flat.u16"), os.path.join(root, "starts.npy")
    offsets, written, pos = [], 0, 0
    with open(flat, "wb") as out:
        while written < num_tokens:
            lengths = np.maximum(rng.lognormal(np.log(params["median"]), params["sigma"], 2048).astype(np.int64), 1)
            ids = (rng.zipf(params["zipf"], int(lengths.sum())) % EOS).astype(np.uint16)
            pieces = []
            for doc in np.split(ids, np.cumsum(lengths)[:-1]):
                if written >= num_tokens:
                    break
                offsets.append(pos)
                pieces += [doc, np.array([EOS], np.uint16)]
                written, pos = written + len(doc), pos + len(doc) + 1
            out.write(np.concatenate(pieces).tobytes())
    offsets.append(pos)
    np.save(starts, np.array(offsets, np.int64))
    meta = {"params": params, "root": root, "flat": flat, "starts": starts, "documents": len(offsets) - 1,
            "tokens": written, "flat_tokens": pos, "formats": {}}
    save_meta(meta)
    return meta


def save_meta(meta: dict) -> None:
    with open(os.path.join(meta["root"], "corpus.json"), "w") as f:
        json.dump(meta, f, indent=1)


def documents(meta: dict):
    """Each document (without its EOS) as a uint16 array, in corpus order."""
    flat = np.memmap(meta["flat"], np.uint16, mode="r")
    starts = np.load(meta["starts"])
    for lo, hi in zip(starts[:-1].tolist(), starts[1:].tolist()):
        yield np.asarray(flat[lo : hi - 1])


def blocks(meta: dict):
    """The flat token stream cut into non-overlapping 2049-token blocks (a short tail dropped)."""
    flat = np.memmap(meta["flat"], np.uint16, mode="r")
    for i in range(len(flat) // BLOCK):
        yield np.asarray(flat[i * BLOCK : (i + 1) * BLOCK])


def dir_bytes(path: str) -> tuple[int, int]:
    total = files = 0
    for base, _, names in os.walk(path):
        for name in names:
            total += os.path.getsize(os.path.join(base, name))
            files += 1
    return total, files


# -- writers (each runs in a child process) ------------------------------------------------------
def write_streamforge(meta: dict, out: str, shard_size: str = f"{SHARD_MIB}MiB") -> None:
    from streamforge import ShardWriter

    with ShardWriter(out, shard_size=shard_size, eos_id=EOS, vocab_size=VOCAB) as writer:
        for doc in documents(meta):
            writer.write(doc)


def _litdata_group(args):
    """One input of ``litdata.optimize``: a run of documents, each with its EOS, as tensors."""
    import torch

    flat_path, lo, hi = args
    flat = np.memmap(flat_path, np.uint16, mode="r")
    starts = np.load(os.path.join(os.path.dirname(flat_path), "starts.npy"), mmap_mode="r")
    for a, b in zip(starts[lo:hi].tolist(), starts[lo + 1 : hi + 1].tolist()):
        yield torch.from_numpy(np.array(flat[a:b], np.int32)).to(torch.uint16)


def write_litdata(meta: dict, out: str, compression: str | None) -> None:
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    step = 2000
    inputs = [(meta["flat"], lo, min(lo + step, meta["documents"])) for lo in range(0, meta["documents"], step)]
    litdata.optimize(fn=_litdata_group, inputs=inputs, output_dir=out, chunk_bytes=f"{SHARD_MIB}MB",
                     item_loader=TokensLoader(), compression=compression, num_workers=1,
                     # TokensLoader chunks take whole-chunk zstd only (framed zstd is for pytrees)
                     compression_level="chunk" if compression else None,
                     reorder_files=False, verbose=False)


def write_mosaic(meta: dict, out: str) -> None:
    install_torchvision_stub()
    from streaming import MDSWriter

    with MDSWriter(out=out, columns={"tokens": "bytes"}, size_limit=SHARD_MIB * 2**20) as writer:
        for block in blocks(meta):
            writer.write({"tokens": block.tobytes()})


def write_webdataset(meta: dict, out: str) -> None:
    import webdataset as wds

    os.makedirs(out, exist_ok=True)
    with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=SHARD_MIB * 2**20, verbose=0) as writer:
        for i, block in enumerate(blocks(meta)):
            writer.write({"__key__": f"{i:09d}", "u16": block.tobytes()})
    # WebDataset has no index: the shard list is the user's to keep
    with open(os.path.join(out, "shards.json"), "w") as f:
        json.dump(sorted(n for n in os.listdir(out) if n.endswith(".tar")), f)


def write_format(meta: dict, system: str, out: str) -> None:
    if system == "streamforge":
        write_streamforge(meta, out)
    elif system.startswith("litdata"):
        write_litdata(meta, out, "zstd" if system == "litdata-zstd" else None)
    elif system == "mosaic":
        write_mosaic(meta, out)
    elif system == "webdataset":
        write_webdataset(meta, out)
    else:
        raise ValueError(system)


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


# ================================================================================================
# loaders (each built in a child process)
# ================================================================================================
def _blocks_to_int64(samples):
    """Collate: a list of 2049-token blocks (uint16 arrays or tensors) -> one [8, 2049] int64 tensor."""
    import torch

    if isinstance(samples[0], torch.Tensor):
        return torch.stack(samples).to(torch.int64)
    return torch.from_numpy(np.stack(samples).astype(np.int64))


def _mosaic_collate(samples):
    return _blocks_to_int64([np.frombuffer(s["tokens"], np.uint16) for s in samples])


def _wds_decode(sample):
    return np.frombuffer(sample["u16"], np.uint16)


class Case:
    """One system's loader for one case: build it, count and fingerprint its batches, save and
    load its state."""

    def __init__(self, system: str, location: str, workers: int, s3: dict | None, cache: str) -> None:
        self.system, self.location, self.workers, self.s3, self.cache = system, location, workers, s3, cache

    # -- building --------------------------------------------------------------------------
    MODULES = {"streamforge": ["streamforge"], "litdata": ["litdata"], "mosaic": ["streaming"],
               "webdataset": ["webdataset", "torchdata.stateful_dataloader"]}
    # the client each system reads S3 with, imported lazily by the system on its first read
    S3_MODULES = {"streamforge": ["obstore", "s3fs"], "litdata": ["obstore"], "mosaic": ["boto3"], "webdataset": ["boto3"]}

    def preload(self) -> None:
        """Import the system's modules (and, for S3, its storage client) before any clock
        starts: every system's imports are left out alike."""
        import importlib

        if self.system == "mosaic":
            install_torchvision_stub()
        family = self.system.split("-")[0]
        for name in self.MODULES[family] + (self.S3_MODULES[family] if self.s3 else []):
            importlib.import_module(name)

    def build(self):
        return getattr(self, "_build_" + self.system.split("-")[0])()

    def _build_streamforge(self):
        from streamforge import PackedTokenDataset, Stream, StreamingLoader
        from streamforge.storage.config import StorageConfig

        settings = {}
        if self.system == EQUAL:
            settings = {"shuffle_buffer": EQUAL_SHUFFLE, "storage": StorageConfig(prefetch_bytes=EQUAL_READ_AHEAD)}
        options = None
        if self.s3:
            options = {"key": CREDS["AWS_ACCESS_KEY_ID"], "secret": CREDS["AWS_SECRET_ACCESS_KEY"],
                       "client_kwargs": {"endpoint_url": self.s3["endpoint"]}, "skip_instance_cache": True}
        dataset = PackedTokenDataset(Stream(self.location, storage_options=options, name="corpus"),
                                     seq_len=SEQ_LEN, seed=0, **settings)
        return StreamingLoader(dataset, batch_size=BATCH, num_workers=self.workers, device="cpu")

    def _build_litdata(self):
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import TokensLoader
        from litdata.streaming.resolver import Dir

        options = {}
        if self.s3:
            # LitData fetches chunks with obstore, which refuses http:// endpoints unless its
            # client options say allow_http; LitData passes fixed client options (so the
            # AWS_ALLOW_HTTP variable is not read) and has no setting for it: add it here.
            from litdata.streaming import downloader

            if self.s3["endpoint"].startswith("http://"):
                downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
            options = {"endpoint_url": self.s3["endpoint"], "aws_access_key_id": CREDS["AWS_ACCESS_KEY_ID"],
                       "aws_secret_access_key": CREDS["AWS_SECRET_ACCESS_KEY"]}
            input_dir = Dir(path=self.cache, url=self.location)
        else:
            input_dir = self.location
        dataset = StreamingDataset(input_dir, item_loader=TokensLoader(block_size=BLOCK), shuffle=True, seed=0,
                                   drop_last=False, storage_options=options)
        return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=self.workers, collate_fn=_blocks_to_int64)

    def _build_mosaic(self):
        install_torchvision_stub()
        from streaming import StreamingDataLoader, StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        if self.s3:  # Mosaic copies each shard from remote into local, then reads it there
            dataset = StreamingDataset(remote=self.location, local=self.cache, shuffle=True, shuffle_seed=0,
                                       batch_size=BATCH)
        else:
            dataset = StreamingDataset(local=self.location, shuffle=True, shuffle_seed=0, batch_size=BATCH)
        return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=self.workers, collate_fn=_mosaic_collate,
                                   drop_last=False)

    def _build_webdataset(self):
        import webdataset as wds
        from torchdata.stateful_dataloader import StatefulDataLoader

        with open(os.path.join(self.s3["listing"] if self.s3 else self.location, "shards.json")) as f:
            names = json.load(f)
        if self.s3:  # WebDataset reads http URLs through curl (its gopen): presigned GETs
            import boto3

            client = boto3.client("s3", endpoint_url=self.s3["endpoint"])
            bucket, _, prefix = self.location[len("s3://"):].partition("/")
            urls = [client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": f"{prefix}/{n}"},
                                                  ExpiresIn=24 * 3600) for n in names]
        else:
            urls = [os.path.join(self.location, n) for n in names]
        dataset = (wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False)
                   .shuffle(1000, seed=0).map(_wds_decode).batched(BATCH, collation_fn=_blocks_to_int64))
        return StatefulDataLoader(dataset, batch_size=None, num_workers=self.workers)

    # -- batches ---------------------------------------------------------------------------
    def tokens(self, batch) -> int:
        """Corpus tokens a batch consumed: streamforge's non-padding positions; a peer's blocks
        times 2049 (its blocks do not overlap)."""
        if self.system.startswith("streamforge"):
            # numpy, not torch: three tensor ops a batch cost ~30 us, 10% of a 0-worker pass,
            # on streamforge's clock alone (a peer's count is one numel())
            doc_ids = batch["doc_ids"].numpy()
            return doc_ids.size if doc_ids[-1, -1] >= 0 else int((doc_ids >= 0).sum())
        return batch.numel()

    def digest(self, batch) -> str:
        h = hashlib.sha1()
        if self.system.startswith("streamforge"):
            for key in ("input_ids", "labels", "position_ids", "doc_ids", "source_ids"):
                h.update(batch[key].numpy().tobytes())
        else:
            h.update(batch.numpy().tobytes())
        return h.hexdigest()


# ================================================================================================
# the child: one case in a fresh process
# ================================================================================================
def tree_cpu() -> float:
    """CPU-seconds (user + sys) of this process, its live descendants and all reaped ones."""
    try:
        import psutil
    except ImportError:  # reaped children only: workers still alive are missed
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    me = psutil.Process()
    total = 0.0
    for proc in [me] + me.children(recursive=True):
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def child_pass(spec: dict) -> dict:
    """One uninterrupted pass; with ``capture``, fingerprints of every batch and the loader's
    state after each batch count in ``capture["at"]``."""
    case = Case(spec["system"], spec["location"], spec["workers"], spec.get("s3"), spec["cache"])
    capture = spec.get("capture")
    at = set(capture["at"]) if capture else set()
    digests = []
    case.preload()
    cpu0 = tree_cpu()
    start = time.perf_counter()
    loader = case.build()
    tokens = batches = 0
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - start
        tokens += case.tokens(batch)
        batches += 1
        if capture:
            digests.append(case.digest(batch))
            if batches in at:
                with open(os.path.join(capture["dir"], f"state-{batches}.pkl"), "wb") as f:
                    pickle.dump(loader.state_dict(), f)
    seconds = time.perf_counter() - start
    cpu = tree_cpu() - cpu0
    if capture:
        with open(os.path.join(capture["dir"], "digests.json"), "w") as f:
            json.dump(digests, f)
    return {"seconds": seconds, "first": first, "tokens": tokens, "batches": batches, "cpu": cpu}


def child_resume(spec: dict) -> dict:
    """A new loader + its saved state + the first batch (timed); then the next batches checked
    against the uninterrupted pass."""
    case = Case(spec["system"], spec["location"], spec["workers"], spec.get("s3"), spec["cache"])
    with open(spec["state"], "rb") as f:
        state = pickle.load(f)
    with open(spec["digests"]) as f:
        want = json.load(f)[spec["batch"] :][: spec["check"]]
    case.preload()
    start = time.perf_counter()
    loader = case.build()
    loader.load_state_dict(state)
    it = iter(loader)
    first = next(it)
    seconds = time.perf_counter() - start  # the batch's fingerprint is not the loader's work
    got = [case.digest(first)]
    for batch in it:
        if len(got) >= len(want):
            break
        got.append(case.digest(batch))
    first_bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    return {"seconds": seconds, "checked": min(len(got), len(want)), "exact": got == want,
            "first_bad": first_bad, "short": len(got) < len(want)}


def child_ceiling(spec: dict) -> dict:
    import torch

    cpu0 = tree_cpu()
    start = time.perf_counter()
    if spec["system"] == "contract":
        first, tokens = contract_ceiling(spec["location"], spec["starts"], start)
    elif spec["system"] == "memmap":
        flat = np.memmap(spec["location"], np.uint16, mode="r")
        step = BATCH * BLOCK
        tokens = first = 0
        for lo in range(0, len(flat) - step + 1, step):
            batch = torch.from_numpy(flat[lo : lo + step].astype(np.int64).reshape(BATCH, BLOCK))
            first = first or time.perf_counter() - start
            tokens += batch.numel()
    else:
        from bench_pipeline import load_frames, time_zstd

        shards, _ = load_frames(spec["location"])  # shard bytes read before the clock
        start = time.perf_counter()
        cpu0 = tree_cpu()
        time_zstd(shards)
        first, tokens = None, spec["tokens"]
    return {"seconds": time.perf_counter() - start, "first": first, "tokens": tokens, "batches": None,
            "cpu": tree_cpu() - cpu0}


def contract_ceiling(flat_path: str, starts_path: str, start: float) -> tuple[float, int]:
    """streamforge's five batch tensors built straight from the flat file, in file order (no
    decoding, no shuffle, no state): what any loader that hands out the full contract pays
    on top of reading its tokens. One pass of 8x2048 rows; returns (first batch s, tokens)."""
    import torch

    flat = np.memmap(flat_path, np.uint16, mode="r")
    doc_starts = np.load(starts_path)  # each document's first token; EOS closes each document
    size = BATCH * SEQ_LEN
    ramp = np.arange(size, dtype=np.int64)
    row_starts = ramp[::SEQ_LEN]
    first = tokens = 0
    for lo in range(0, len(flat) - size, size):
        window = flat[lo : lo + size + 1]
        input_ids = window[:size].astype(np.int64).reshape(BATCH, SEQ_LEN)
        labels = window[1:].astype(np.int64)
        # documents starting inside the batch; the token before each is an EOS: no label
        a = np.searchsorted(doc_starts, lo, side="right")
        b = np.searchsorted(doc_starts, lo + size, side="right")
        inside = doc_starts[a:b] - lo
        labels[inside - 1] = -100
        # segments: documents cut at row starts
        cuts = np.concatenate((inside[inside < size], row_starts))
        cuts.sort()
        cuts = cuts[np.concatenate(([True], cuts[1:] != cuts[:-1]))]
        seg_len = np.diff(np.append(cuts, size))
        positions = ramp - np.repeat(cuts, seg_len)
        row_first = np.searchsorted(cuts, row_starts)
        doc_ids = np.repeat((np.arange(len(cuts)) - row_first[cuts // SEQ_LEN]).astype(np.int32), seg_len)
        batch = {
            "input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels.reshape(BATCH, SEQ_LEN)),
            "position_ids": torch.from_numpy(positions.reshape(BATCH, SEQ_LEN)),
            "doc_ids": torch.from_numpy(doc_ids.reshape(BATCH, SEQ_LEN)),
            "source_ids": torch.from_numpy(np.zeros(size, np.int16).reshape(BATCH, SEQ_LEN)),
        }
        first = first or time.perf_counter() - start
        tokens += size
    return first, tokens


def child_main(spec: dict) -> None:
    if spec.get("s3"):
        os.environ.update(CREDS)
    kind = spec["kind"]
    if kind == "write":
        meta = spec["meta"]
        start = time.perf_counter()
        write_format(meta, spec["system"], spec["out"])
        out = {"seconds": time.perf_counter() - start}
    elif kind == "pass":
        out = child_ceiling(spec) if spec["system"] in CEILINGS else child_pass(spec)
    elif kind == "resume":
        out = child_resume(spec)
    elif kind == "growth":
        out = growth_child(spec)
    else:
        raise ValueError(kind)
    sys.stdout.flush()
    print("\n@@RESULT " + json.dumps(out), flush=True)


# ================================================================================================
# the parent: children, sampling, the S3 server
# ================================================================================================
class ChildFailed(RuntimeError):
    pass


def run_child(spec: dict, timeout: float, env: dict | None = None) -> dict:
    """Run ``spec`` in a fresh process (its own session); sample the RSS of its process tree
    every 50 ms; return its result with ``rss`` (peak of the summed tree, bytes)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        spec_path = f.name
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", spec_path], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)
    peak, deadline = 0, time.monotonic() + timeout
    try:
        root = psutil.Process(proc.pid) if psutil else None
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise ChildFailed(f"timed out after {timeout:.0f} s")
            if root is not None:
                total = 0
                try:
                    for p in [root] + root.children(recursive=True):
                        try:
                            total += p.memory_info().rss
                        except psutil.Error:
                            pass
                except psutil.Error:
                    pass
                peak = max(peak, total)
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and its workers
            proc.wait()
        os.unlink(spec_path)
    log.seek(0)
    text = log.read()
    log.close()
    marker = text.rfind("@@RESULT ")
    if proc.returncode != 0 or marker < 0:
        raise ChildFailed(f"exit {proc.returncode}: {error_line(text)}")
    out = json.loads(text[marker + len("@@RESULT "):].splitlines()[0])
    out["rss"] = peak if psutil else None
    return out


def error_line(text: str) -> str:
    """The exception line of a child's traceback (else its last line), shortened."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    found = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", line)]
    return (found[-1] if found else (lines[-1] if lines else "no output"))[:300]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_S3_SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()
server.stop()
"""


class S3Server:
    """moto's S3 on 127.0.0.1 in a child process of this one, stopped by its pid."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-c", _S3_SERVER, str(self.port)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **CREDS})
        if self.proc.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError("the moto S3 server did not start")

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(key=CREDS["AWS_ACCESS_KEY_ID"], secret=CREDS["AWS_SECRET_ACCESS_KEY"],
                                 client_kwargs={"endpoint_url": self.endpoint}, skip_instance_cache=True)

    def upload(self, local: str, prefix: str) -> None:
        fs = self.fs()
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        fs.put(local.rstrip("/") + "/", f"{BUCKET}/{prefix}/", recursive=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.communicate("", timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


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


# ================================================================================================
# the run
# ================================================================================================
def package_versions() -> dict[str, str]:
    out = {}
    for name in ("streamforge", "torch", "numpy", "zstandard", "litdata", "obstore", "mosaicml-streaming",
                 "webdataset", "torchdata", "moto", "psutil"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def missing_package(system: str) -> str | None:
    package = PACKAGES.get(system)
    if package is None:
        return None
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return f"`{package}` is not installed (`make venv-bench`)"
    if system == "webdataset":
        try:
            importlib.metadata.version("torchdata")
        except importlib.metadata.PackageNotFoundError:
            return "`torchdata` is not installed (`make venv-bench`)"
    return None


def ensure_formats(meta: dict, systems: list[str], timeout: float) -> None:
    """Each system's copy of the corpus, written by its own writer in a fresh process; a
    writer that fails leaves its reason in ``meta["formats"]``."""
    for system in systems:
        have = meta["formats"].get(system)
        if have and "error" not in have:
            continue
        reason = missing_package(system)
        if reason:
            meta["formats"][system] = {"error": reason}
            continue
        out = os.path.join(meta["root"], "fmt", system)
        shutil.rmtree(out, ignore_errors=True)
        print(f"  writing the {system} format ...", flush=True)
        try:
            got = run_child({"kind": "write", "system": system, "meta": meta, "out": out}, timeout)
            size, files = dir_bytes(out)
            meta["formats"][system] = {"dir": out, "bytes": size, "files": files, "write_s": got["seconds"]}
        except ChildFailed as e:
            meta["formats"][system] = {"error": f"writer failed: {e}"}
        save_meta(meta)


def location(meta: dict, system: str, backend: str, s3: S3Server | None) -> str:
    if system in ("memmap", "contract"):
        return meta["flat"]
    if system in ("zstd", EQUAL):  # streamforge's shards
        system = "streamforge"
    if backend == "local":
        return meta["formats"][system]["dir"]
    return f"s3://{BUCKET}/{os.path.basename(meta['root'])}/{system}"


def case_spec(meta: dict, system: str, workers: int, backend: str, s3: S3Server | None, cache: str) -> dict:
    spec = {"kind": "pass", "system": system, "workers": workers, "location": location(meta, system, backend, s3),
            "cache": cache, "tokens": meta["flat_tokens"], "starts": meta["starts"]}
    if backend == "s3":
        spec["s3"] = {"endpoint": s3.endpoint, "listing": meta["formats"][system]["dir"]}
    return spec


CHILD_ENV = {
    "S3_ENDPOINT_URL": "",  # Mosaic's S3 endpoint: set per run
    "LITDATA_DISABLE_VERSION_CHECK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def child_env(spec: dict) -> dict:
    env = dict(CHILD_ENV)
    if spec.get("s3"):
        env.update(CREDS)
        env["S3_ENDPOINT_URL"] = spec["s3"]["endpoint"]
        env["AWS_ENDPOINT_URL"] = spec["s3"]["endpoint"]
    return env


def run_case(spec: dict, timeout: float) -> dict:
    os.makedirs(os.path.dirname(spec["cache"]), exist_ok=True)
    shutil.rmtree(spec["cache"], ignore_errors=True)
    try:
        return run_child(spec, timeout, child_env(spec))
    finally:
        shutil.rmtree(spec["cache"], ignore_errors=True)


def systems_at(args, tokens: int) -> list[str]:
    """The systems measured at a corpus size: all at the main (smallest) one, ``--large-systems``
    at larger ones."""
    if tokens == min(args.tokens) or args.large_systems is None:
        return list(args.systems)
    return [s for s in args.systems if s in args.large_systems]


def measure_size(size: int, meta: dict, args, s3: S3Server | None) -> dict:
    """Throughput cases (interleaved per repeat) and, at the main size, resume for one corpus size."""
    from tqdm import tqdm

    ok = [s for s in systems_at(args, size) if "error" not in meta["formats"].get(s, {"error": "not written"})]
    cases = [(c, 0, "local") for c in CEILINGS if "streamforge" in ok]
    cases += [(s, w, b) for s in ok for b in args.backends for w in args.workers]
    if "streamforge" in ok and "local" in args.backends and 0 in args.workers:
        cases.insert(cases.index(("streamforge", 0, "local")) + 1, (EQUAL, 0, "local"))
    cache = os.path.join(ROOT, "bench-out", "peers", "cache", "run")
    runs: dict = {c: [] for c in cases}
    errors: dict = {}
    with tqdm(total=args.repeats * len(cases), desc=f"passes t{meta['tokens']:.0e}", leave=False) as bar:
        for _ in range(args.repeats):
            for case in cases:
                bar.set_postfix_str("/".join(map(str, case)))
                if case not in errors and case[2] == "s3" and case[0].startswith("litdata"):
                    reason = litdata_index_mismatch(meta["formats"][case[0]]["dir"])
                    if reason:
                        errors[case] = reason
                if case not in errors:
                    try:
                        runs[case].append(run_case(case_spec(meta, *case, s3, cache), args.timeout))
                    except ChildFailed as e:
                        errors[case] = str(e)
                bar.update()
    # resume: on the main corpus only (positions scale with it)
    resume = {} if args.no_resume or size > min(args.tokens) else measure_resume(meta, args, ok, runs, errors, s3)
    return {"runs": runs, "errors": errors, "resume": resume}


def measure_resume(meta: dict, args, systems: list[str], runs: dict, errors: dict, s3) -> dict:
    from tqdm import tqdm

    w = args.resume_workers
    out = {}
    cache = os.path.join(ROOT, "bench-out", "peers", "cache", "resume")
    for system in tqdm(systems, desc="resume", leave=False):
        key = (system, w, "local")
        if not runs.get(key):
            out[system] = {"error": errors.get(key, "no uninterrupted pass to resume in")}
            continue
        n = runs[key][0]["batches"]
        at = sorted({max(1, min(n - 1, round(f * n))) for f in POSITIONS})
        cdir = os.path.join(meta["root"], "resume", system)
        shutil.rmtree(cdir, ignore_errors=True)
        os.makedirs(cdir)
        spec = case_spec(meta, system, w, "local", s3, cache)
        try:
            got = run_case({**spec, "capture": {"dir": cdir, "at": at}}, args.timeout)
        except ChildFailed as e:
            out[system] = {"error": f"capture pass failed: {e}"}
            continue
        res = {"batches": got["batches"], "at": at, "times": {b: [] for b in at}, "exact": {b: [] for b in at},
               "checked": {b: [] for b in at}, "errors": {}}
        for _ in range(args.repeats):
            for b in at:
                if b in res["errors"]:
                    continue
                rspec = {**spec, "kind": "resume", "state": os.path.join(cdir, f"state-{b}.pkl"),
                         "digests": os.path.join(cdir, "digests.json"), "batch": b, "check": args.resume_check}
                try:
                    r = run_case(rspec, args.timeout)
                except ChildFailed as e:
                    res["errors"][b] = str(e)
                    continue
                res["times"][b].append(r["seconds"])
                res["exact"][b].append(r["exact"])
                res["checked"][b].append(r["checked"])
        out[system] = res
    return out


# ================================================================================================
# the report
# ================================================================================================
def med(values) -> float:
    return float(statistics.median(values))


def case_stats(rs: list[dict]) -> dict:
    return {"rate": [r["tokens"] / r["seconds"] for r in rs],
            "cpu_per_b": [r["cpu"] / r["tokens"] * 1e9 for r in rs],
            "first": [r["first"] for r in rs if r["first"] is not None],
            "rss": [r["rss"] for r in rs if r.get("rss")]}


def row_label(system: str, workers: int, backend: str) -> str:
    if system in CEILINGS:
        return NAMES[system]
    return f"{NAMES[system]} | {workers} | {'local disk' if backend == 'local' else 'loopback S3'}"


def throughput_table(res: dict, args) -> list[str]:
    lines = ["| system | workers | storage | tokens/s, M (min-max) | x streamforge | CPU-s per 1B tokens | "
             "first batch, s | peak RSS, MiB (tree) |", "|---|---|---|---|---|---|---|---|"]
    runs, errors = res["runs"], res["errors"]
    base = {}
    for (system, w, b), rs in runs.items():
        if system == "streamforge" and rs:
            base[w, b] = med(case_stats(rs)["rate"])
    for (system, w, b), rs in runs.items():
        if system in CEILINGS:
            label = f"{NAMES[system]} | 0 | local disk"
        else:
            label = row_label(system, w, b)
        if not rs:
            lines.append(f"| {label} | not runnable: {errors.get((system, w, b), 'no result')} | | | | |")
            continue
        st = case_stats(rs)
        ref = base.get((w, b)) if system not in CEILINGS else base.get((0, "local"))
        ratio = f"{med(st['rate']) / ref:.2f}" if ref else "-"
        first = spread(st["first"], fmt="{:.3f}") if st["first"] else "-"
        rss = spread(st["rss"], 2**20, "{:.0f}") if st["rss"] else "-"
        lines.append(f"| {label} | {spread(st['rate'], M)}{failed_runs(rs, errors.get((system, w, b)), args)} | "
                     f"{ratio} | {spread(st['cpu_per_b'], fmt='{:.0f}')} | {first} | {rss} |")
    return lines


def failed_runs(rs: list, error: str | None, args) -> str:
    """What a row leaves out: the runs of a case that failed, with the last one's error."""
    if error is None or len(rs) >= args.repeats:
        return ""
    return f"; {len(rs)} of {args.repeats} runs, the others failed: {error}"


def scale_table(results: dict, args) -> list[str]:
    sizes = sorted(results)
    head = " | ".join(f"{t / M:g}M tokens" for t in sizes)
    lines = [f"| system | workers | storage | {head} | largest / main |", "|---" * (4 + len(sizes)) + "|"]
    keys = [k for k in results[sizes[0]]["runs"] if k[0] not in CEILINGS]
    for key in keys:
        rates = []
        for t in sizes:
            rs = results[t]["runs"].get(key) or []
            rates.append(med(case_stats(rs)["rate"]) if rs else None)
        cells = " | ".join(f"{r / M:.1f}M" if r else ("not run" if key[0] not in systems_at(args, t) else "-")
                           for r, t in zip(rates, sizes))
        grow = f"{rates[-1] / rates[0]:.2f}x" if rates[0] and rates[-1] else "-"
        lines.append(f"| {row_label(*key)} | {cells} | {grow} |")
    left_out = {}
    for key in keys:
        for t in sizes[1:]:
            if key[0] not in systems_at(args, t) and results[sizes[0]]["runs"].get(key):
                rate = med(case_stats(results[sizes[0]]["runs"][key])["rate"])
                left_out.setdefault((key[0], t), []).append(t / rate)
    if left_out:
        lines += ["", "Not run at the larger size (`--large-systems`), with the pass one case would take there "
                  "at its tokens/s on the main corpus: " + "; ".join(
                      f"{NAMES[system]} at {t / M:g}M tokens, {min(secs):.0f}-{max(secs):.0f} s a pass"
                      for (system, t), secs in left_out.items()) + "."]
    return lines


def resume_table(res: dict, args) -> list[str]:
    head = " | ".join(f"at {f:.0%}" for f in POSITIONS)
    lines = [f"| system | fresh start: first batch, s | {head} |", "|---" * (2 + len(POSITIONS)) + "|"]
    for system, r in res["resume"].items():
        fresh = res["runs"].get((system, args.resume_workers, "local")) or []
        fresh_s = spread(case_stats(fresh)["first"], fmt="{:.3f}") if fresh else "-"
        if "error" in r:
            lines.append(f"| {NAMES[system]} | {fresh_s} | not runnable: {r['error']} | | |")
            continue
        cells = []
        for b in r["at"]:
            b = str(b) if str(b) in r["times"] else b
            if r["errors"].get(b):
                cells.append(f"failed: {r['errors'][b]}")
                continue
            exact = all(r["exact"][b])
            checked = min(r["checked"][b])
            cells.append(f"{spread(r['times'][b], fmt='{:.3f}')} s, batch {b}/{r['batches']}, "
                         f"{'exact' if exact else '**not exact**'} ({checked} batches checked)")
        lines.append(f"| {NAMES[system]} | {fresh_s} | " + " | ".join(cells) + " |")
    return lines


PEERS = tuple(s for s in SYSTEMS if s != "streamforge")


def _rate(res: dict, key) -> float | None:
    rs = res["runs"].get(key) or []
    return med(case_stats(rs)["rate"]) if rs else None


def _best_peer(res: dict, workers: int, backend: str, what: str = "rate", least: bool = False):
    """(system, median) of the peer with the highest ``what`` (the lowest with ``least``) in
    one configuration, or None when no peer ran there."""
    found = []
    for system in PEERS:
        rs = res["runs"].get((system, workers, backend)) or []
        values = case_stats(rs)[what] if rs else []
        if values:
            found.append((med(values), system))
    if not found:
        return None
    value, system = min(found) if least else max(found)
    return system, value


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "**missed**")


def bound_note(res: dict) -> list[str]:
    """What bounds the 0-worker throughput target, from this run's ceilings."""
    contract, zstd, best = _rate(res, ("contract", 0, "local")), _rate(res, ("zstd", 0, "local")), \
        _best_peer(res, 0, "local")
    if not (contract and zstd and best):
        return []
    one_core = 1 / (1 / contract + 1 / zstd)
    return [
        f"What bounds the 0-worker target: building the five tensors of the contract, with no decode, no "
        f"shuffle and no state, runs at {contract / M:.0f}M tokens/s on one core ({contract / best[1]:.2f}x "
        f"{NAMES[best[0]]}); with zstd decoding on the same core the two come to {one_core / M:.0f}M "
        f"({one_core / best[1]:.2f}x), and with the decoding moved to the second core, as the read-ahead does, "
        f"the contract alone is the bound. 1.5x the fastest peer is {1.5 * best[1] / contract:.0%} of that "
        "ceiling, before any shuffling, packing or state is paid for.", "",
    ]


def targets_table(res: dict, args, larger: dict | None = None) -> list[str]:
    """Each target of the comparison, measured in this run on the main corpus: streamforge's
    figure, the figure it is held against, and whether it is met; ``larger`` (size: results)
    adds the workers target on the larger corpora."""
    rows = []
    for w, b in ((0, "local"), (2, "local"), (2, "s3")):
        ours, best = _rate(res, ("streamforge", w, b)), _best_peer(res, w, b)
        if ours and best:
            rows.append((f"tokens/s >= 1.5x the fastest peer, {w} workers, {'local' if b == 'local' else 'S3'}",
                         f"{ours / M:.1f}M", f"{NAMES[best[0]]} {best[1] / M:.1f}M",
                         f"{ours / best[1]:.2f}x", ours >= 1.5 * best[1]))
    contract, ours0, best0 = _rate(res, ("contract", 0, "local")), _rate(res, ("streamforge", 0, "local")), \
        _best_peer(res, 0, "local")
    if contract and best0:
        rows.append(("bound: the full contract from a flat memmap (no decode, no shuffle, one core) / the "
                     "fastest peer, 0 workers, local", f"{contract / M:.1f}M", f"{best0[1] / M:.1f}M",
                     f"{contract / best0[1]:.2f}x", None))
    for w in sorted({w for (_, w, b) in res["runs"] if b == "s3"}):
        rs = res["runs"].get(("streamforge", w, "s3")) or []
        best = _best_peer(res, w, "s3", "first", least=True)
        if rs and best:
            ours = med(case_stats(rs)["first"])
            rows.append((f"first batch from S3 <= 0.5x the fastest peer's, {w} workers", f"{ours:.3f} s",
                         f"{NAMES[best[0]]} {best[1]:.3f} s", f"{ours / best[1]:.2f}x", ours <= 0.5 * best[1]))
    resume = res.get("resume") or {}
    ours_r = resume.get("streamforge") or {}
    for i, frac in enumerate(POSITIONS):
        if "at" not in ours_r or i >= len(ours_r["at"]):
            break
        ours = ours_r["times"].get(ours_r["at"][i]) or ours_r["times"].get(str(ours_r["at"][i]))
        peers = []
        for system in PEERS:
            r = resume.get(system) or {}
            if "at" not in r or i >= len(r["at"]):
                continue
            b = r["at"][i]
            times, exact = r["times"].get(b) or r["times"].get(str(b)), r["exact"].get(b) or r["exact"].get(str(b))
            if times and exact and all(exact):
                peers.append((med(times), system))
        if ours and peers:
            best_t, best_s = min(peers)
            rows.append((f"resume at {frac:.0%} <= 0.5x the fastest exact peer's, {args.resume_workers} workers",
                         f"{med(ours):.3f} s", f"{NAMES[best_s]} {best_t:.3f} s", f"{med(ours) / best_t:.2f}x",
                         med(ours) <= 0.5 * best_t))
    lightest = _best_peer(res, 0, "local", "rss", least=True)
    for system in ("streamforge", EQUAL):
        rs = res["runs"].get((system, 0, "local")) or []
        if rs and lightest and case_stats(rs)["rss"]:
            ours = med(case_stats(rs)["rss"])
            rows.append((f"peak RSS <= the lightest peer's, 0 workers, local: {NAMES[system]}",
                         f"{ours / 2**20:.0f} MiB", f"{NAMES[lightest[0]]} {lightest[1] / 2**20:.0f} MiB",
                         f"{ours / lightest[1]:.2f}x", ours <= lightest[1]))
    for size, sized in [(None, res)] + [(t, r) for t, r in sorted((larger or {}).items())]:
        for b in ("local", "s3"):
            two, zero = _rate(sized, ("streamforge", 2, b)), _rate(sized, ("streamforge", 0, b))
            if two and zero:
                at = f", {size / M:g}M-token corpus" if size else ""
                rows.append((f"2 workers >= 0 workers, {'local' if b == 'local' else 'S3'}{at}", f"{two / M:.1f}M",
                             f"{zero / M:.1f}M", f"{two / zero:.2f}x", two >= zero))
    zstd = _rate(res, ("zstd", 0, "local"))
    if zstd and ours0:
        rows.append(("0 workers, local >= 50% of raw zstd decoding of the same shards (one core)",
                     f"{ours0 / M:.1f}M", f"{zstd / M:.1f}M", f"{ours0 / zstd:.0%}", ours0 >= 0.5 * zstd))
    lines = ["| target | streamforge | against | ratio | |", "|---|---|---|---|---|"]
    lines += [f"| {t} | {a} | {b} | {r} | {_verdict(ok)} |" for t, a, b, r, ok in rows]
    return lines


def formats_table(meta: dict) -> list[str]:
    lines = ["| system | format, as its own writer wrote it | files | MB on disk | write, s |", "|---|---|---|---|---|"]
    kinds = {"streamforge": "tar/zstd shards (`ShardWriter`, 16 MiB, zstd level 3), one record per document",
             "litdata-zstd": "`litdata.optimize(..., item_loader=TokensLoader(), compression='zstd')`, 16 MB chunks, "
                             "one item per document",
             "litdata-raw": "`litdata.optimize(..., item_loader=TokensLoader())`, 16 MB chunks, one item per document",
             "mosaic": "`MDSWriter(columns={'tokens': 'bytes'}, size_limit=16 MiB)`, uncompressed, one sample "
                       "per 2049-token block",
             "webdataset": "`wds.ShardWriter(maxsize=16 MiB)` tar, uncompressed, one sample per 2049-token block"}
    for system, f in meta["formats"].items():
        if "error" in f:
            lines.append(f"| {NAMES[system]} | not written: {f['error']} | | | |")
        else:
            lines.append(f"| {NAMES[system]} | {kinds[system]} | {f['files']} | {f['bytes'] / M:.1f} | "
                         f"{f['write_s']:.1f} |")
    return lines


def plot_peers(res: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]
    systems = [s for s in SYSTEMS if any(k[0] == s for k in runs)]
    configs = sorted({(w, b) for (s, w, b) in runs if s not in CEILINGS}, key=lambda c: (c[1] != "local", c[0]))
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / max(1, len(configs))
    for i, (w, b) in enumerate(configs):
        vals, lo, hi = [], [], []
        for s in systems:
            rs = runs.get((s, w, b)) or []
            r = [x / M for x in case_stats(rs)["rate"]] if rs else [0.0]
            vals.append(med(r))
            lo.append(med(r) - min(r))
            hi.append(max(r) - med(r))
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(systems))]
        bars = ax.bar(xs, vals, width, yerr=[lo, hi], capsize=2,
                      label=f"{w} workers, {'local disk' if b == 'local' else 'loopback S3'}")
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "n/a" for v in vals], fontsize=7)
    for c, style in zip(CEILINGS, (":", "-.", "--")):
        rs = runs.get((c, 0, "local")) or []
        if rs:
            ax.axhline(med(case_stats(rs)["rate"]) / M, color="gray", linestyle=style, linewidth=1,
                       label=f"{NAMES[c]} ({med(case_stats(rs)['rate']) / M:.0f}M)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(systems)), [NAMES[s].replace(" + ", "\n+ ").replace(", ", ",\n") for s in systems],
                  fontsize=8)
    ax.set_ylabel("tokens/s (millions, log), median; bars: min-max")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    from _benchdoc import save_figure

    save_figure(fig, path)


def peers_section(results: dict, metas: dict, args, run: dict) -> str:
    from streamforge.storage.config import LOCAL_READ_AHEAD, REMOTE_READ_AHEAD

    main = min(results)
    res, meta = results[main], metas[main]
    command, load = run["command"], run["load"]
    vers = ", ".join(f"{k} {v}" for k, v in run["versions"].items())
    large = [t for t in sorted(results) if t != main]
    sizes_text = ", ".join(f"{metas[t]['documents']:,} documents, {metas[t]['tokens']:,} tokens" for t in large)
    lines = [
        "## streamforge next to LitData, MosaicML Streaming and WebDataset (`tools/bench_peers.py`)", "",
        f"`{command}`, {run['date']}, {platform.machine()} with {os.cpu_count()} CPUs "
        f"(shared with other work; load average {load} at the end), Python {platform.python_version()}.", "",
        f"Versions: {vers}.", "",
        f"Corpus: {meta['documents']:,} documents, {meta['tokens']:,} tokens (plus one EOS each), lognormal "
        "lengths (median 600, sigma 1.0), ids `zipf(1.3) % 50256`, one deterministic generator; every "
        "system wrote it in its own format with its own writer, 16 MiB shards or chunks:", "",
        *formats_table(meta), "",
        f"The job: one pass of packed 2049-token int64 blocks in batches of {BATCH}. streamforge "
        "(`PackedTokenDataset(url, seq_len=2048, seed=0)`, `StreamingLoader(batch_size=8)`) delivers its full "
        "batch contract: input_ids, labels, position_ids, doc_ids, source_ids, documents shuffled in "
        "8192-document windows (the first windows of each pass growing from 256), default read-ahead "
        f"(local {LOCAL_READ_AHEAD[0] >> 20} MiB on one fetch thread, S3 {REMOTE_READ_AHEAD[0] >> 20} MiB on four), S3 read through obstore's client in the "
        "training process and over signed HTTP requests (`storage/s3http.py`) in forked workers (`StorageConfig.client='auto'`, docs/storage.md); **the peers deliver bare `[8, 2049]` int64 token blocks** "
        "(LitData's `TokensLoader(block_size=2049)` with `shuffle=True`; Mosaic's `shuffle=True`; "
        "WebDataset's shard shuffle and a 1000-block sample shuffle, seeded). tokens/s counts corpus tokens "
        "delivered (streamforge: non-padding positions; a peer: 2049 per block) over the seconds from "
        "building the loader to the end of the pass, imports excluded (the system's modules and, from S3, "
        "the client it reads with: s3fs, obstore or boto3, imported before the clock starts). Each case runs "
        "in a fresh "
        f"process; medians of {args.repeats} runs (min-max), cases interleaved within each repeat. "
        "CPU-seconds: user + sys of the case process and its workers (psutil, sampled at the start and the "
        "end of the pass, reaped children included), per billion tokens; the S3 server's CPU is not counted. "
        "Peak RSS: the summed RSS of the case process and its descendants, sampled every 50 ms from the "
        "parent with psutil (pages shared by forked workers count once per process). Loopback S3: moto on "
        "127.0.0.1 in a child of the tool, started and stopped by it. Ratios: tokens/s over streamforge's "
        "with the same workers and storage (ceilings: over streamforge's with 0 workers, local disk).", "",
        "![tokens/s per system](img/peers_throughput.png)", "",
        *throughput_table(res, args), "",
        f"{NAMES[EQUAL]}: `shuffle_buffer={EQUAL_SHUFFLE}` (about the 2M tokens of WebDataset's 1000-block "
        f"sample buffer) and `StorageConfig(prefetch_bytes={EQUAL_READ_AHEAD >> 20} MiB)`, the settings at which "
        "its memory is compared (docs/storage.md says what each knob buys).", "",
    ]
    if large:
        lines += [
            "Start-up against steady state: the same cases on a corpus 10x larger, written the same way "
            f"({sizes_text}; tokens/s, medians); "
            "a system whose fixed costs (worker start, index reads, first downloads) matter gains most.", "",
            *scale_table(results, args), "",
        ]
    if res["resume"]:
        lines += [
            f"Resume with each system's own mechanism, {args.resume_workers} workers, local disk: a fresh process "
            "builds the loader, loads the state saved after that many batches of an uninterrupted pass and takes "
            f"the first batch (timed, median (min-max) of {args.repeats}); the next {args.resume_check} batches "
            "(or the rest of the pass) are compared with the uninterrupted pass's, bit for bit. Mechanisms: "
            "streamforge `loader.state_dict()`/`load_state_dict()`; LitData's and Mosaic's "
            "`StreamingDataLoader.state_dict()`/`load_state_dict()`; WebDataset in torchdata's "
            "`StatefulDataLoader` (WebDataset keeps no state of its own, so the loader replays the "
            "samples already seen to get back to the position).", "",
            *resume_table(res, args), "",
        ]
    lines += [
        "The targets, each measured in this run (a bound is a ceiling, not a target):", "",
        *targets_table(res, args, {t: results[t] for t in large}), "",
        *bound_note(res),
        "Workarounds, all confined to the benchmark's own processes:", "",
        "- **MosaicML Streaming** imports torchvision when it is imported (`streaming.vision`), and the "
        "registry's torchvision wheel does not load with this torch (`RuntimeError: operator torchvision::nms "
        "does not exist`). Each Mosaic process gets a stand-in `torchvision` module (`install_torchvision_stub`) "
        "before importing `streaming`; text datasets never call into it. mosaicml-streaming also pins "
        "`google-cloud-storage<3.3`, below what gcsfs (a test extra) needs: the peers live in their own "
        "venv, `make venv-bench`.",
        "- **LitData** downloads chunks with obstore, which refuses `http://` endpoints unless its client "
        "options say `allow_http`; LitData passes fixed client options (so obstore's `AWS_ALLOW_HTTP` "
        "variable is not read) and has no setting for it, so the LitData processes add `allow_http` to "
        "`litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS` when the endpoint is plain http. The endpoint "
        "and keys go in `storage_options`; chunks are cached in a fresh directory per run, removed after it.",
        "- **WebDataset** reads http URLs through `curl` (its `gopen`); moto refuses anonymous GETs, so the "
        "shard URLs are presigned (boto3) when the loader is built. Its shard list is kept beside the shards "
        "(`shards.json`), WebDataset having no index.",
        "- **MosaicML Streaming** from S3 copies each shard into a local cache directory (fresh per run) and "
        "reads it there; `S3_ENDPOINT_URL` names the endpoint.",
    ]
    return "\n".join(lines)


# ================================================================================================
# streamforge alone: how the cost grows
# ================================================================================================
GROWTH_SHARD_MIB = (4, 16, 64, 256)
GROWTH_STREAMS = (1, 3, 10, 30)
GROWTH_BUFFERS = (256, 2048, 8192, 32768)
GROWTH_SHARDS = (10, 100, 1000, 10000, 100000)


def growth_child(spec: dict) -> dict:
    """One streamforge pass (or only its first batch) over ``spec["streams"]``."""
    from streamforge import PackedTokenDataset, Stream, StreamingLoader  # imported before the clock

    cpu0 = tree_cpu()
    start = time.perf_counter()
    streams = [Stream(url, weight=w, name=f"s{i}") for i, (url, w) in enumerate(spec["streams"])]
    dataset = PackedTokenDataset(streams, seq_len=SEQ_LEN, seed=0, shuffle_buffer=spec.get("shuffle_buffer", 8192),
                                 eos_id=EOS)
    loader = StreamingLoader(dataset, batch_size=BATCH, num_workers=spec.get("workers", 0), device="cpu")
    tokens = batches = 0
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - start
            if spec.get("first_only"):
                break
        doc_ids = batch["doc_ids"]
        tokens += doc_ids.numel() if doc_ids[-1, -1] >= 0 else int((doc_ids >= 0).sum())
        batches += 1
    return {"seconds": time.perf_counter() - start, "first": first, "tokens": tokens, "batches": batches,
            "cpu": tree_cpu() - cpu0}


def write_streams(meta: dict, out: str, shard_size: str, num_streams: int) -> list[str]:
    """The corpus dealt round-robin into ``num_streams`` streamforge streams."""
    from streamforge import ShardWriter

    urls = [os.path.join(out, f"s{i}") for i in range(num_streams)]
    writers = [ShardWriter(u, shard_size=shard_size, eos_id=EOS, vocab_size=VOCAB) for u in urls]
    for i, doc in enumerate(documents(meta)):
        writers[i % num_streams].write(doc)
    for w in writers:
        w.close()
    return urls


def write_many_shards(out: str, num_shards: int) -> str:
    """A stream of ``num_shards`` one-record shards (tiny documents): a big manifest, little data."""
    from streamforge import ShardWriter

    rng = np.random.default_rng(0)
    size = max(64, -(-4 * BATCH * BLOCK // num_shards))  # enough tokens for a few batches
    with ShardWriter(out, shard_size=1, eos_id=EOS, vocab_size=VOCAB) as writer:
        for _ in range(num_shards):
            writer.write(rng.integers(0, EOS, size, dtype=np.int64).astype(np.uint16))
    return out


def growth_corpora(args) -> tuple[dict, dict]:
    """{(curve, x): [(url, weight), ...]} for every point, built once under the workdir."""
    from tqdm import tqdm

    meta = ensure_flat(os.path.join(args.workdir, f"growth-t{int(args.growth_tokens)}"), int(args.growth_tokens))
    root = os.path.join(meta["root"], "sf")
    done_path = os.path.join(root, "done.json")
    done = json.load(open(done_path)) if os.path.exists(done_path) else {}
    points = [("shard", m) for m in GROWTH_SHARD_MIB] + [("streams", n) for n in GROWTH_STREAMS]
    points += [("shards", n) for n in GROWTH_SHARDS if n <= args.growth_max_shards]
    out = {}
    for curve, x in tqdm(points, desc="growth corpora", leave=False):
        key = f"{curve}-{x}"
        if key not in done:
            path = os.path.join(root, key)
            shutil.rmtree(path, ignore_errors=True)
            if curve == "shard":
                urls = write_streams(meta, path, f"{x}MiB", 1)
            elif curve == "streams":
                urls = write_streams(meta, path, f"{SHARD_MIB}MiB", x)
            else:
                urls = [write_many_shards(path, x)]
            done[key] = urls
            os.makedirs(root, exist_ok=True)
            with open(done_path, "w") as f:
                json.dump(done, f)
        urls = done[key]
        # the mixture: stream i weighs i + 1 (the heaviest 30x the lightest at 30 streams)
        out[curve, x] = [(u, float(i + 1)) for i, u in enumerate(urls)]
    for b in GROWTH_BUFFERS:
        out["buffer", b] = out["shard", SHARD_MIB]
    return out, meta


def measure_growth(args) -> dict:
    from tqdm import tqdm

    corpora, meta = growth_corpora(args)
    results: dict = {k: [] for k in corpora}
    errors: dict = {}
    with tqdm(total=args.growth_repeats * len(corpora), desc="growth", leave=False) as bar:
        for _ in range(args.growth_repeats):
            for (curve, x), streams in corpora.items():
                spec = {"kind": "growth", "streams": streams, "first_only": curve == "shards",
                        "shuffle_buffer": x if curve == "buffer" else 8192}
                if (curve, x) not in errors:
                    try:
                        results[curve, x].append(run_child(spec, args.timeout))
                    except ChildFailed as e:
                        errors[curve, x] = str(e)
                bar.update()
    shards = {}
    for (curve, x), streams in corpora.items():
        from streamforge.source import ShardSource

        shards[curve, x] = sum(ShardSource.open(u).manifest.num_shards for u, _ in streams)
    return {"results": results, "errors": errors, "shards": shards, "meta": meta}


def plot_growth(g: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = g["results"]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
    panels = [("shard", "shard size (MiB)"), ("streams", "streams (mixture, weights 1..N)"),
              ("buffer", "shuffle buffer (documents)")]
    for ax, (curve, label) in zip(axes, panels):
        xs = sorted(x for c, x in res if c == curve and res[c, x])
        rate = [med([r["tokens"] / r["seconds"] for r in res[curve, x]]) / M for x in xs]
        rss = [med([r["rss"] for r in res[curve, x] if r.get("rss")] or [0]) / 2**20 for x in xs]
        ax.plot(xs, rate, "o-", color="C0")
        ax.set_xscale("log", base=2 if curve != "streams" else 10)
        ax.set_xlabel(label)
        ax.set_ylabel("tokens/s (M), 0 workers", color="C0")
        ax.set_ylim(bottom=0)
        twin = ax.twinx()
        twin.plot(xs, rss, "s--", color="C3")
        twin.set_ylabel("peak RSS (MiB)", color="C3")
        twin.set_ylim(bottom=0)
    ax = axes[3]
    xs = sorted(x for c, x in res if c == "shards" and res[c, x])
    ax.plot(xs, [med([r["first"] for r in res["shards", x]]) for x in xs], "o-", color="C2")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("shards in the manifest")
    ax.set_ylabel("time to first batch (s)")
    fig.suptitle("streamforge: how the cost grows (medians)", fontsize=10)
    from _benchdoc import save_figure

    save_figure(fig, path)


def growth_section(g: dict, args, command: str) -> str:
    res, meta = g["results"], g["meta"]
    lines = [
        "## streamforge: how the cost grows (`tools/bench_peers.py`, growth)", "",
        f"`{command}`, {datetime.date.today().isoformat()}, {platform.machine()} with {os.cpu_count()} CPUs "
        f"(shared), Python {platform.python_version()}. streamforge alone, 0 workers, local disk, one pass of "
        f"{BATCH}x{SEQ_LEN} full-contract batches over a {meta['tokens'] / M:.0f}M-token corpus (the peers "
        "comparison's generator), each point in a fresh process, medians of "
        f"{args.growth_repeats}; peak RSS summed over the process tree (psutil, every 50 ms). Shard sizes are "
        "`ShardWriter(shard_size=...)` (raw token bytes per shard); streams split the corpus round-robin, "
        "stream i weighing i + 1; the many-shards manifests hold one record per shard (64 tokens, more where "
        "the manifest is small, so that it holds a few batches) and only the first batch is taken.", "",
        "![how the cost grows](img/growth.png)", "",
        "| curve | point | shards | tokens/s, M (min-max) | first batch, s | peak RSS, MiB |", "|---|---|---|---|---|---|",
    ]
    units = {"shard": "{} MiB shards", "streams": "{} streams", "buffer": "shuffle buffer {}",
             "shards": "{} shards"}
    for (curve, x), rs in res.items():
        label = units[curve].format(x)
        if not rs:
            lines.append(f"| {curve} | {label} | {g['shards'][curve, x]} | not runnable: "
                         f"{g['errors'].get((curve, x), 'no result')} | | |")
            continue
        rate = "-" if curve == "shards" else spread([r["tokens"] / r["seconds"] for r in rs], M)
        rss = spread([r["rss"] for r in rs if r.get("rss")], 2**20, "{:.0f}") if rs[0].get("rss") else "-"
        firsts = [r["first"] for r in rs if r["first"] is not None]
        first = spread(firsts, fmt="{:.3f}") if firsts else "no batch"
        lines.append(f"| {curve} | {label} | {g['shards'][curve, x]} | {rate} | {first} | {rss} |")
    lines += ["", *growth_notes(g)]
    return "\n".join(lines)


def growth_notes(g: dict) -> list[str]:
    """What the curves show, with the measured ends of each, and why they bend where they do."""
    res = g["results"]

    def ends(curve, what):
        xs = sorted(x for c, x in res if c == curve and res[c, x])
        if len(xs) < 2:
            return None
        vals = []
        for x in (xs[0], xs[-1]):
            rs = res[curve, x]
            if what == "rate":
                vals.append(med([r["tokens"] / r["seconds"] for r in rs]) / M)
            elif what == "rss":
                vals.append(med([r["rss"] for r in rs if r.get("rss")] or [0]) / 2**20)
            else:
                vals.append(med([r["first"] for r in rs if r["first"] is not None] or [float("nan")]))
        return xs[0], xs[-1], vals[0], vals[1]

    out = ["Where the curves bend, and why:", ""]
    e, r, f = ends("shard", "rate"), ends("shard", "rss"), ends("shard", "first")
    if e and r:
        out.append(
            f"- **Shard size** ({e[0]} to {e[1]} MiB): tokens/s {e[2]:.1f}M to {e[3]:.1f}M, peak RSS {r[2]:.0f} to "
            f"{r[3]:.0f} MiB. The reader fetches zstd frames by byte range and decodes one frame at a time, so "
            "memory stays flat and tokens/s moves within the noise (see the min-max); the shards column shows "
            "where the corpus is a single shard, past which larger sizes change nothing.")
    e, r, f = ends("streams", "rate"), ends("streams", "rss"), ends("streams", "first")
    if e and r and f:
        out.append(
            f"- **Streams** ({e[0]} to {e[1]}, weights 1..N): tokens/s {e[2]:.1f}M to {e[3]:.1f}M, first batch "
            f"{f[2]:.3f} to {f[3]:.3f} s, peak RSS {r[2]:.0f} to {r[3]:.0f} MiB, on a corpus of "
            f"{g['meta']['tokens'] / M:.0f}M tokens. Profiled (cProfile, 0 workers): the token-share schedule "
            "hands over to another stream every document or two, so a batch holds a piece of a run for each "
            "stream it draws from, and each costs a reader call (about 10 us; the run's tokens stay views of the "
            "frames, regrouped by document in the schedule's order and copied once), where one stream takes "
            "one run a batch; the schedule itself is one merge of the streams' share ratios "
            "for every document their windows show, cut into batches (`Interleaver._planned`; docs/design.md "
            "gives what merging a document, then a batch at a time cost). The first batch "
            "waits for the first window of every stream its documents come from (at the start every ratio "
            "is 0, so the first documents come from as many streams), and each stream holds its own shuffle "
            "window, so memory grows with N; the read-ahead does not, as the streams share one budget "
            "(docs/storage.md).")
    e, r, f = ends("buffer", "rate"), ends("buffer", "rss"), ends("buffer", "first")
    if e and r and f:
        out.append(
            f"- **Shuffle buffer** ({e[0]} to {e[1]} documents): tokens/s {e[2]:.1f}M to {e[3]:.1f}M, first "
            f"batch {f[2]:.3f} to {f[3]:.3f} s, peak RSS {r[2]:.0f} to {r[3]:.0f} MiB. The window holds that "
            "many documents, so the memory grows with it until the window holds the whole stream (the corpus "
            f"has {g['meta']['documents']:,} documents); tokens/s and the first batch move within the noise of "
            "this shared machine (see the min-max).")
    f = ends("shards", "first")
    xs = sorted(x for c, x in res if c == "shards" and res[c, x])
    if f:
        firsts = {x: med([r["first"] for r in res["shards", x] if r["first"] is not None] or [float("nan")])
                  for x in xs}
        steps = ", ".join(f"{x:,}: {firsts[x]:.3f} s" for x in xs)
        out.append(
            f"- **Shards in the manifest** ({steps}). Each shard here holds one record, and the first shuffle "
            "window holds 256 documents (the warm-up; windows grow to 8192), so the first batch reads one "
            "record, an index and a frame, from each of the first min(N, 256) shards of its plan: that is the "
            "rise up to a thousand shards. Past 256 shards the reads stop growing, and what still grows is "
            "the manifest itself and the pass's plan, which is the bend after ten thousand: the manifest's "
            "JSON holds a name and a digest a shard, and the plan a range a shard, which the plan, the "
            "reader and its read-ahead each keep (the peak RSS column). Each is built in one numpy step or "
            "one pass over a list, never a call a shard (docs/design.md, \"A manifest of many shards\"), "
            "with Python's garbage collector paused until the first batch: the objects built per shard would "
            "otherwise set it off, a full collection of every object in the process included (`collector.paused`). "
            "Real shards hold thousands of documents each, so a manifest of N shards costs far less than N "
            "records' worth of reads.")
    if max(xs, default=0) < max(GROWTH_SHARDS):
        out.append(f"- The {max(GROWTH_SHARDS):,}-shard point was not run (`--growth-max-shards {max(xs, default=0)}`); "
                   "writing its corpus takes about 20 s.")
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, nargs="+", default=[50e6, 500e6],
                   help="corpus sizes; the table is the largest, each other is compared with it "
                        "(start-up against steady state); default 50e6 500e6")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--large-systems", nargs="+", choices=SYSTEMS,
                   help="systems measured at the sizes above the smallest (default: all of --systems)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--backends", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    p.add_argument("--resume-workers", type=int, default=2)
    p.add_argument("--resume-check", type=int, default=32, help="batches compared after each resume")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--no-growth", action="store_true", help="skip streamforge's growth curves")
    p.add_argument("--only-growth", action="store_true", help="only streamforge's growth curves")
    p.add_argument("--growth-tokens", type=float, default=20e6, help="corpus of the growth curves")
    p.add_argument("--growth-repeats", type=int, default=3)
    p.add_argument("--growth-max-shards", type=int, default=100000,
                   help="largest manifest of the first-batch curve (default 100000; writing it takes minutes)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for one child process")
    p.add_argument("--out", default=os.path.join("docs", "benchmarks.md"))
    p.add_argument("--workdir", default=os.path.join(ROOT, "bench-out", "peers"))
    p.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    p.add_argument("--report-only", action="store_true",
                   help="write the peers section again from the last run's results (last-run.json), measuring nothing")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tokens = sorted(int(t) for t in args.tokens)
    if min(args.tokens) < BATCH * BLOCK * 20:
        p.error(f"--tokens must be >= {BATCH * BLOCK * 20}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        with open(args.child) as f:
            child_main(json.load(f))
        return 0
    command = "python tools/bench_peers.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {}
    if args.report_only:
        return report_only(args)
    if not args.only_growth:
        metas = {}
        for tokens in args.tokens:
            meta = ensure_flat(os.path.join(args.workdir, f"t{tokens}"), tokens)
            print(f"corpus t{tokens}: {meta['documents']:,} documents, {meta['tokens']:,} tokens", flush=True)
            ensure_formats(meta, systems_at(args, tokens), args.timeout)
            metas[tokens] = meta
        s3 = None
        if "s3" in args.backends:
            s3 = S3Server()
        try:
            for tokens, meta in metas.items():
                if s3:
                    for system in systems_at(args, tokens):
                        if "error" not in meta["formats"][system]:
                            s3.upload(meta["formats"][system]["dir"], f"{os.path.basename(meta['root'])}/{system}")
                results[tokens] = measure_size(tokens, meta, args, s3)
        finally:
            if s3:
                s3.stop()
        run = {"command": command.strip(), "versions": package_versions(), "date": datetime.date.today().isoformat(),
               "load": ", ".join(f"{x:.1f}" for x in os.getloadavg()), "args": vars(args)}
        dump = {"metas": {str(t): m for t, m in metas.items()}, "results": {str(t): encode(r) for t, r in results.items()},
                "run": run}
        with open(os.path.join(args.workdir, "last-run.json"), "w") as f:
            json.dump(dump, f, indent=1)
        publish_peers(results, metas, args, run)
    if not args.no_growth:
        g = measure_growth(args)
        text = growth_section(g, args, command.strip())
        print(text)
        if not args.no_write:
            from _benchdoc import publish

            publish("growth", text, args.out, lambda path: plot_growth(g, path), "growth.png")
    return 0


def publish_peers(results: dict, metas: dict, args, run: dict) -> None:
    text = peers_section(results, metas, args, run)
    print(text)
    if not args.no_write:
        from _benchdoc import publish

        title = f"One pass of {BATCH}x{BLOCK} blocks, {min(results) / M:g}M tokens"
        publish("peers", text, args.out, lambda path: plot_peers(results[min(results)], path, title),
                "peers_throughput.png")


def report_only(args) -> int:
    """Write the peers section again from the last run's results (``last-run.json``), with that
    run's command, settings, versions and date: a change to the report without a rerun."""
    with open(os.path.join(args.workdir, "last-run.json")) as f:
        dump = json.load(f)
    run = dump.get("run")
    if run is None:  # a run from before the run was saved: its settings as given now
        run = {"command": "python tools/bench_peers.py " + " ".join(a for a in sys.argv[1:] if a != "--report-only"),
               "versions": package_versions(), "date": datetime.date.today().isoformat(),
               "load": ", ".join(f"{x:.1f}" for x in os.getloadavg()), "args": vars(args)}
    for key in ("systems", "large_systems", "workers", "backends", "repeats", "resume_workers", "resume_check"):
        setattr(args, key, run["args"][key])
    args.tokens = sorted(int(t) for t in dump["results"])
    metas = {int(t): m for t, m in dump["metas"].items()}
    results = {int(t): decode(r) for t, r in dump["results"].items()}
    publish_peers(results, metas, args, run)
    return 0


def decode(res: dict) -> dict:
    """A size's results from JSON: 'system|workers|backend' keys back to tuples."""
    def key(text: str) -> tuple:
        system, workers, backend = text.split("|")
        return system, int(workers), backend

    return {"runs": {key(k): v for k, v in res["runs"].items()}, "errors": {key(k): v for k, v in res["errors"].items()},
            "resume": res["resume"]}


def encode(obj):
    """JSON-able copy: tuple keys as 'system|workers|backend'."""
    if isinstance(obj, dict):
        return {("|".join(map(str, k)) if isinstance(k, tuple) else str(k)): encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
