"""Grain, the loader torchtitan uses, built the way torchtitan builds it: ArrayRecord files of
documents (``ArrayRecordWriter``, ``group_size:1`` as Grain asks, the writer's default zstd:3
per record; a new file each 16 MiB of documents); ``MapDataset.source(ArrayRecordDataSource)``
``.shuffle(seed)``, the records decoded to uint16 tokens; ``.to_iter_dataset(ReadOptions(
num_threads=4, prefetch_buffer_size=64))``; ``ConcatThenSplitIterDataset`` packing into
2049-token rows; ``.batch(8, drop_remainder=True)``; ``.mp_prefetch(MultiprocessingOptions(
num_workers=N))`` for N workers; resume through the iterator's ``get_state``/``set_state``.

``mp_prefetch`` starts its workers with multiprocessing's spawn (each imports the pipeline's
modules afresh: part of Grain's first batch with workers), and each worker runs the pipeline up
to the batch on its slice of the shuffled records, as torchtitan's does."""

from __future__ import annotations

import os

import numpy as np

from .settings import BATCH, BLOCK, EOS, SHARD_MIB

NUM_THREADS, PREFETCH = 4, 64
# Why the S3 cells have no Grain figure (reported in their place)
S3_REASON = ("Grain reads local paths only: `ArrayRecordDataSource` opens each file with array_record's "
             "C++ `ArrayRecordReader`, which reads the local file system (no object-storage client); "
             "an S3 bucket would have to be mounted or copied to local disk first")


def write_grain(meta: dict, out: str) -> None:
    """Each document with its EOS as one record (uint16 bytes), corpus order, a new file after
    each 16 MiB of records."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from .corpus import documents

    os.makedirs(out, exist_ok=True)
    limit, index, size, writer = SHARD_MIB << 20, 0, 0, None
    eos = np.array([EOS], np.uint16)
    for doc in documents(meta):
        if writer is None or size >= limit:
            if writer is not None:
                writer.close()
            writer = ArrayRecordWriter(os.path.join(out, f"docs-{index:05d}.array_record"), "group_size:1")
            index, size = index + 1, 0
        record = np.concatenate((doc, eos)).tobytes()
        writer.write(record)
        size += len(record)
    if writer is not None:
        writer.close()


def _decode(record: bytes) -> dict:
    return {"tokens": np.frombuffer(record, np.uint16)}


def _to_int64(batch: dict) -> np.ndarray:
    return batch["tokens"].astype(np.int64)


def grain_dataset(location: str, workers: int):
    import grain
    from grain.experimental import ConcatThenSplitIterDataset

    paths = sorted(os.path.join(location, n) for n in os.listdir(location) if n.endswith(".array_record"))
    source = grain.sources.ArrayRecordDataSource(paths)
    ds = grain.MapDataset.source(source).shuffle(seed=0).map(_decode)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=NUM_THREADS, prefetch_buffer_size=PREFETCH))
    ds = ConcatThenSplitIterDataset(ds, length_struct={"tokens": BLOCK})
    ds = ds.batch(BATCH, drop_remainder=True).map(_to_int64)
    if workers:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return ds


class GrainLoader:
    """Grain's dataset as the other loaders are used: iterate it for ``[8, 2049]`` int64
    tensors (zero-copy from the pipeline's arrays); ``state_dict()`` is the live iterator's
    ``get_state()``, ``load_state_dict()`` hands a state to the next iterator's ``set_state()``."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset
        self._it = None
        self._state = None

    def __iter__(self):
        import torch

        it = iter(self.dataset)
        if self._state is not None:
            it.set_state(self._state)
        self._it = it
        try:
            for batch in it:
                yield torch.from_numpy(batch)
        finally:
            close = getattr(it, "close", None)
            if close is not None:  # mp_prefetch's worker processes
                close()

    def state_dict(self):
        return self._it.get_state()

    def load_state_dict(self, state) -> None:
        self._state = state


def grain_loader(case) -> GrainLoader:
    if case.s3:
        raise RuntimeError(S3_REASON)
    return GrainLoader(grain_dataset(case.location, case.workers))
