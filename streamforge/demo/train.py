"""The demo's training job: a tiny causal transformer trained on packed, document-masked batches.

What a real pretraining loop does with a streamforge batch, in small:

- ``position_ids`` index the position embedding (0 at the start of every document piece);
- attention is causal *within* each document (``packed_causal_mask(doc_ids)``), so packed
  neighbours never see each other;
- the loss is taken on ``labels`` as they come (already shifted, -100 where no next token of
  the same document exists).

A checkpoint holds the model, the optimizer and the loader state (plain JSON), plus the losses so
far and the job's configuration, so ``resume`` in a new process needs nothing else. CPU runs are
bit-for-bit repeatable with the same thread count; on CUDA, deterministic algorithms are
switched on (``CUBLAS_WORKSPACE_CONFIG``) and attention runs on the math kernel.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import PackedTokenDataset, Stream, StreamingLoader
from ..pipeline.masks import packed_causal_mask


@dataclass
class JobConfig:
    """Everything the resumed process needs to rebuild the job (stored in the checkpoint)."""

    streams: list[dict[str, Any]]  # Stream fields: url, weight, name, storage_options
    schedule: list[tuple[int, dict[str, float]]]
    vocab_size: int
    eos_id: int
    steps: int
    checkpoint_at: int
    seq_len: int = 256
    batch_size: int = 8
    num_workers: int = 0
    seed: int = 0
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    lr: float = 3e-3
    threads: int = 2
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        with _math_attention(x.device):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Embeddings (token + position from ``position_ids``), pre-norm blocks, tied head."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, num_layers: int, num_heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, num_heads) for _ in range(num_layers))
        self.ln = nn.LayerNorm(d_model)
        for table in (self.tok, self.pos):
            nn.init.normal_(table.weight, std=0.02)  # a tied head starts near uniform

    def forward(self, input_ids, position_ids, doc_ids) -> torch.Tensor:
        # document-causal mask [B, 1, T, T]; the diagonal keeps padding rows finite (their
        # labels are -100, so they never reach the loss)
        eye = torch.eye(input_ids.shape[1], dtype=torch.bool, device=input_ids.device)
        mask = (packed_causal_mask(doc_ids) | eye).unsqueeze(1)
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln(x) @ self.tok.weight.T


def _math_attention(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])  # deterministic backward


def setup_determinism(cfg: JobConfig) -> torch.device:
    """Same threads, deterministic kernels: what makes two processes' losses bit-identical."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)  # warn, never raise, on an op without one
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def build_loader(cfg: JobConfig, device: torch.device) -> StreamingLoader:
    streams = [Stream(**s) for s in cfg.streams]
    dataset = PackedTokenDataset(
        streams, seq_len=cfg.seq_len, seed=cfg.seed, shuffle_buffer=1024, packing="concat",
        eos_id=cfg.eos_id, infinite=True, weights=[(step, dict(w)) for step, w in cfg.schedule],
    )
    return StreamingLoader(dataset, batch_size=cfg.batch_size, num_workers=cfg.num_workers, device=device)


def build_model(cfg: JobConfig, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(cfg.seed)
    model = TinyTransformer(cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.num_layers, cfg.num_heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    return model, optimizer


@dataclass
class TrainResult:
    losses: list[float]  # one per step, from the first step this process trained
    first_step: int
    seconds: float
    data_wait_s: float
    tokens: int
    stats: dict[str, Any]
    checkpoint: Path | None = None
    resume_latency_s: float | None = None  # checkpoint load to first resumed batch


def train(cfg: JobConfig, out_dir: Path, *, resume_from: Path | None = None, bar_desc: str = "train") -> TrainResult:
    """Train to ``cfg.steps``; from scratch (saving a checkpoint after ``checkpoint_at``
    steps) or from ``resume_from``."""
    from tqdm import tqdm

    from .report import progress_disabled

    device = setup_determinism(cfg)
    started = time.perf_counter()
    model, optimizer = build_model(cfg, device)
    loader = build_loader(cfg, device)
    first_step, checkpoint = 0, None
    if resume_from is not None:
        ckpt = torch.load(resume_from, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"], strict=True)
        first_step = loader.step
    losses: list[float] = []
    bar = tqdm(total=cfg.steps, initial=first_step, desc=bar_desc, unit="step", disable=progress_disabled(),
               dynamic_ncols=True, mininterval=0.5)
    latency, wait, tokens = None, 0.0, 0
    run_start = time.perf_counter()
    batches = iter(loader)
    for step in range(first_step, cfg.steps):
        t0 = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - t0
        if latency is None and resume_from is not None:
            latency = time.perf_counter() - started
        logits = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        tokens += batch["input_ids"].numel()
        bar.update(1)
        if step % 10 == 0:
            rate = tokens / (time.perf_counter() - run_start)
            bar.set_postfix_str(f"loss {losses[-1]:.3f}, {rate / 1e3:.1f}k tokens/s", refresh=False)
        if resume_from is None and step + 1 == cfg.checkpoint_at:
            checkpoint = out_dir / f"checkpoint-step-{cfg.checkpoint_at}.pt"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "loader": json.loads(json.dumps(loader.state_dict())),  # plain JSON
                        "losses": list(losses), "config": asdict(cfg)}, checkpoint)
    seconds = time.perf_counter() - run_start
    bar.close()
    stats = loader.stats()
    del batches
    return TrainResult(losses, first_step, seconds, wait, tokens, stats, checkpoint, latency)


def config_from_checkpoint(path: Path) -> JobConfig:
    raw = torch.load(path, map_location="cpu", weights_only=False)["config"]
    raw["schedule"] = [(int(step), dict(w)) for step, w in raw["schedule"]]
    return JobConfig(**raw)


def bits(values: list[float]) -> list[str]:
    """Exact float representations (a loss curve compared bit for bit)."""
    return [float(v).hex() for v in values]


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
