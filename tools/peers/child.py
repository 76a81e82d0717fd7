"""One case in a fresh process (``tools/bench_peers.py --child SPEC``): a writer, an uninterrupted
pass, a resume from a saved state, a ceiling or a growth point; the result goes to stdout after
an ``@@RESULT`` marker."""

from __future__ import annotations

import json
import os
import pickle
import sys
import time

import numpy as np

from .corpus import write_format
from .growth import growth_child
from .harness import tree_cpu
from .loaders import Case
from .settings import BATCH, BLOCK, CEILINGS, CREDS, SEQ_LEN


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
        del batch  # built and dropped, as a loader's consumer would: the building is the cost
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
