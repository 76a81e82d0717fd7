"""The corpus (per ``--tokens`` size, built once under the workdir): lognormal document lengths
(median 600, sigma 1.0), ids ``zipf(1.3) % 50256``, each document followed by EOS 50256, as one
flat uint16 file with the documents' start offsets; then each system's copy of it, written by
that system's own writer with 16 MiB shards or chunks (each writer runs in a child process)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from .settings import BLOCK, EOS, SHARD_MIB, VOCAB


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
    elif system == "grain":
        from .loaders_grain import write_grain

        write_grain(meta, out)
    else:
        raise ValueError(system)

