"""What the loader does on a real GPU: copy time, overlap, attention kernels on packed batches.

Run on a machine with a CUDA device (it exits with status 2 and says so where there is none):

    python tools/gpu_check.py [--steps 60] [--step-ms 20] [--write-doc]

1. Host-to-device time per batch: pinned batches copied ``non_blocking`` on a side stream,
   timed with CUDA events (median over the batches).
2. Overlap: a trainer whose step is a GPU kernel of known duration (``torch.cuda._sleep``)
   takes ``--steps`` batches with ``device_prefetch=0`` (pin and copy on the training thread)
   and with ``device_prefetch=2`` (the default); per step it reports the host time spent in
   ``next(loader)`` and the wall time beyond the GPU step itself (the stall).
3. FlexAttention with ``document_block_mask`` against dense masked attention
   (``packed_causal_mask``) on real packed batches: max abs difference over real tokens.
4. flash-attn varlen (``flash_attn_varlen_func`` with ``cu_seqlens``) against the same, when
   ``flash_attn`` is installed (skipped, and said so, when it is not).

``--write-doc`` puts the figures, with the GPU's name, into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from streamforge import (  # noqa: E402
    PackedTokenDataset, Stream, StreamingLoader, cu_seqlens, document_block_mask, packed_causal_mask,
)
from streamforge.demo.run import STREAMS, build_corpus  # noqa: E402


def make_loader(corpus: Path, args, depth: int, num_workers: int = 2) -> StreamingLoader:
    streams = [Stream(str(corpus / s.name), weight=s.weight, name=s.name) for s in STREAMS]
    ds = PackedTokenDataset(streams, seq_len=args.seq_len, seed=0, eos_id=511, infinite=True)
    return StreamingLoader(ds, batch_size=args.batch_size, num_workers=num_workers, device_prefetch=depth)


def copy_time(corpus: Path, args) -> dict:
    """Median H2D time of one pinned batch on a side stream (CUDA events), and its size."""
    loader = make_loader(corpus, args, depth=0, num_workers=0)
    loader.device = torch.device("cpu")  # take host batches; copy them here, timed
    side = torch.cuda.Stream()
    times, nbytes = [], 0
    for i, batch in zip(range(30), loader):
        host = {k: v.pin_memory() for k, v in batch.items()}
        nbytes = sum(v.numel() * v.element_size() for v in host.values())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            _ = {k: v.to("cuda", non_blocking=True) for k, v in host.items()}
            end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return {"h2d_ms": float(np.median(times)), "batch_mb": nbytes / 1e6, "gb_s": nbytes / 1e6 / np.median(times)}


def sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def overlap(corpus: Path, args, depth: int, cycles_per_ms: float) -> dict:
    loader = make_loader(corpus, args, depth=depth)
    it = iter(loader)
    for _ in range(5):
        next(it)
    torch.cuda.synchronize()
    waits, stalls = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = next(it)
        waits.append(time.perf_counter() - t0)
        torch.cuda._sleep(int(args.step_ms * cycles_per_ms))  # the step: known GPU time
        _ = batch["input_ids"].sum()  # it reads the batch
        torch.cuda.synchronize()
        stalls.append(time.perf_counter() - t0 - args.step_ms / 1000)
    del it
    w, s = np.asarray(waits) * 1e3, np.maximum(np.asarray(stalls), 0) * 1e3
    return {"depth": depth, "wait_p50": np.percentile(w, 50), "wait_p99": np.percentile(w, 99),
            "stall_mean": s.mean(), "stall_share": s.sum() / (s.sum() + args.steps * args.step_ms)}


def attention_checks(corpus: Path, args) -> list[str]:
    from torch.nn.attention.flex_attention import flex_attention

    loader = make_loader(corpus, args, depth=2, num_workers=0)
    batch = next(iter(loader))
    doc_ids = batch["doc_ids"]
    B, T = doc_ids.shape
    H, D = 4, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    real = doc_ids >= 0
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=packed_causal_mask(doc_ids).unsqueeze(1))
    pieces = int((cu_seqlens(doc_ids)[0].numel()) - 1)
    out = [f"batch {B} x {T}, {pieces} document pieces, {H} heads of {D}, bf16 (reference: fp32 dense SDPA)"]
    flex = torch.compile(flex_attention)(q, k, v, block_mask=document_block_mask(doc_ids))
    diff = (flex.float() - dense).transpose(1, 2)[real].abs().max().item()
    out.append(f"FlexAttention + document_block_mask vs dense masked: max abs diff {diff:.2e} "
               f"({'OK' if diff < 2e-2 else 'MISMATCH'})")
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        out.append("flash-attn varlen: not checked (flash_attn is not installed)")
        return out
    bounds, max_len = cu_seqlens(doc_ids)
    flat = [x.transpose(1, 2).reshape(B * T, H, D) for x in (q, k, v)]
    fa = flash_attn_varlen_func(*flat, cu_seqlens_q=bounds, cu_seqlens_k=bounds, max_seqlen_q=max_len,
                                max_seqlen_k=max_len, causal=True).reshape(B, T, H, D)
    diff = (fa.float() - dense.transpose(1, 2))[real].abs().max().item()
    out.append(f"flash-attn varlen + cu_seqlens vs dense masked: max abs diff {diff:.2e} "
               f"({'OK' if diff < 2e-2 else 'MISMATCH'})")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-out/gpu"))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--write-doc", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine. "
              "Nothing was measured.")
        return 2
    name = torch.cuda.get_device_name()
    print(f"GPU: {name}, torch {torch.__version__}")
    corpus = args.out.resolve() / "corpus"
    build_corpus(corpus, 4_000_000, seed=0)
    lines = [f"`python tools/gpu_check.py`, {date.today()}, {name}, torch {torch.__version__}; "
             f"batches of {args.batch_size} x {args.seq_len} tokens, 2 workers."]
    c = copy_time(corpus, args)
    lines.append(f"- host-to-device copy of one pinned batch ({c['batch_mb']:.2f} MB): {c['h2d_ms']:.3f} ms "
                 f"median ({c['gb_s']:.1f} GB/s)")
    cycles = sleep_cycles_per_ms()
    for depth in (0, 2):
        o = overlap(corpus, args, depth, cycles)
        lines.append(f"- {args.step_ms:.0f} ms GPU steps, device_prefetch={depth}: next() p50 {o['wait_p50']:.2f} ms, "
                     f"p99 {o['wait_p99']:.2f} ms; stall {o['stall_mean']:.2f} ms per step "
                     f"({o['stall_share']:.2%} of wall time)")
    lines += [f"- {line}" for line in attention_checks(corpus, args)]
    print("\n".join(lines))
    if args.write_doc:
        from _benchdoc import update_section

        update_section("gpu", "## On a GPU (`tools/gpu_check.py`)\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
