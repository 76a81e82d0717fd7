"""Each system's loader for one case, built in the case's own process: one function per system,
and ``Case``, which builds one, counts and fingerprints its batches."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from .loaders_grain import grain_loader
from .settings import BATCH, BLOCK, CREDS, EQUAL, EQUAL_FIELDS, EQUAL_READ_AHEAD, EQUAL_SHUFFLE, SEQ_LEN


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
               "webdataset": ["webdataset", "torchdata.stateful_dataloader"],
               # Grain hands out NumPy arrays: torch, which the adapter wraps them in, is imported too
               "grain": ["torch", "grain", "grain.experimental", "array_record.python.array_record_module"]}
    # the client each system reads S3 with, imported lazily by the system on its first read
    S3_MODULES = {"streamforge": ["obstore", "s3fs"], "litdata": ["obstore"], "mosaic": ["boto3"], "webdataset": ["boto3"],
                  "grain": []}

    def preload(self) -> None:
        """Import the system's modules (and, for S3, its storage client) before any clock
        starts: every system's imports are left out alike."""
        import importlib

        family = self.system.split("-")[0]
        for name in self.MODULES[family] + (self.S3_MODULES[family] if self.s3 else []):
            importlib.import_module(name)

    def build(self):
        return LOADERS[self.system.split("-")[0]](self)

    # -- batches ---------------------------------------------------------------------------
    def tokens(self, batch) -> int:
        """Corpus tokens a batch consumed: streamforge's non-padding positions; a peer's blocks
        times 2049 (its blocks do not overlap)."""
        if self.system == EQUAL:  # no doc_ids: padding is only in the pass's last batch (< 1 row)
            return batch["input_ids"].numel()
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
                if key in batch:
                    h.update(batch[key].numpy().tobytes())
        else:
            h.update(batch.numpy().tobytes())
        return h.hexdigest()


def streamforge_loader(case: Case):
    """streamforge's full batch contract (``PackedTokenDataset``, ``StreamingLoader``)."""
    from streamforge import PackedTokenDataset, Stream, StreamingLoader
    from streamforge.storage.config import StorageConfig

    settings, fields = {}, None
    if case.system == EQUAL:
        settings = {"shuffle_buffer": EQUAL_SHUFFLE, "storage": StorageConfig(prefetch_bytes=EQUAL_READ_AHEAD)}
        fields = EQUAL_FIELDS
    options = None
    if case.s3:
        options = {"key": CREDS["AWS_ACCESS_KEY_ID"], "secret": CREDS["AWS_SECRET_ACCESS_KEY"],
                   "client_kwargs": {"endpoint_url": case.s3["endpoint"]}, "skip_instance_cache": True}
    dataset = PackedTokenDataset(Stream(case.location, storage_options=options, name="corpus"),
                                 seq_len=SEQ_LEN, seed=0, **settings)
    return StreamingLoader(dataset, batch_size=BATCH, num_workers=case.workers, device="cpu", fields=fields)


def litdata_loader(case: Case):
    """LitData's ``StreamingDataset`` of 2049-token blocks (``TokensLoader``), shuffled."""
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.item_loader import TokensLoader
    from litdata.streaming.resolver import Dir

    options = {}
    if case.s3:
        # LitData fetches chunks with obstore, which refuses http:// endpoints unless its
        # client options say allow_http; LitData passes fixed client options (so the
        # AWS_ALLOW_HTTP variable is not read) and has no setting for it: add it here.
        from litdata.streaming import downloader

        if case.s3["endpoint"].startswith("http://"):
            downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
        options = {"endpoint_url": case.s3["endpoint"], "aws_access_key_id": CREDS["AWS_ACCESS_KEY_ID"],
                   "aws_secret_access_key": CREDS["AWS_SECRET_ACCESS_KEY"]}
        input_dir = Dir(path=case.cache, url=case.location)
    else:
        input_dir = case.location
    dataset = StreamingDataset(input_dir, item_loader=TokensLoader(block_size=BLOCK), shuffle=True, seed=0,
                               drop_last=False, storage_options=options)
    return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=case.workers, collate_fn=_blocks_to_int64)


def mosaic_loader(case: Case):
    """MosaicML Streaming's ``StreamingDataset`` of MDS samples, shuffled."""
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    if case.s3:  # Mosaic copies each shard from remote into local, then reads it there
        dataset = StreamingDataset(remote=case.location, local=case.cache, shuffle=True, shuffle_seed=0,
                                   batch_size=BATCH)
    else:
        dataset = StreamingDataset(local=case.location, shuffle=True, shuffle_seed=0, batch_size=BATCH)
    return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=case.workers, collate_fn=_mosaic_collate,
                               drop_last=False)


def webdataset_loader(case: Case):
    """WebDataset's tar shards in torchdata's ``StatefulDataLoader``, shard and sample shuffle."""
    import webdataset as wds
    from torchdata.stateful_dataloader import StatefulDataLoader

    with open(os.path.join(case.s3["listing"] if case.s3 else case.location, "shards.json")) as f:
        names = json.load(f)
    if case.s3:  # WebDataset reads http URLs through curl (its gopen): presigned GETs
        import boto3

        client = boto3.client("s3", endpoint_url=case.s3["endpoint"])
        bucket, _, prefix = case.location[len("s3://"):].partition("/")
        urls = [client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": f"{prefix}/{n}"},
                                              ExpiresIn=24 * 3600) for n in names]
    else:
        urls = [os.path.join(case.location, n) for n in names]
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False)
               .shuffle(1000, seed=0).map(_wds_decode).batched(BATCH, collation_fn=_blocks_to_int64))
    return StatefulDataLoader(dataset, batch_size=None, num_workers=case.workers)


LOADERS = {"streamforge": streamforge_loader, "litdata": litdata_loader, "mosaic": mosaic_loader,
           "webdataset": webdataset_loader, "grain": grain_loader}
