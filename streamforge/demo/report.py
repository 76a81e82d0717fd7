"""The demo's verdict, report and plot: the resumed loss curve against the reference, the
realized mixture per phase (``loader.stats()["phases"]``), throughput and resume latency."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def compare(ref: dict[str, Any], resumed: dict[str, Any], checkpoint_at: int) -> tuple[bool, list[str]]:
    """(equal?, what was compared): the losses bit for bit from the checkpoint on, and the
    realized mixture per phase at the end."""
    want, got = ref["loss_bits"][checkpoint_at:], resumed["loss_bits"]
    lines = []
    ok = resumed["first_step"] == checkpoint_at and want == got
    if ok:
        lines.append(f"EQUAL: the resumed run's {len(got)} losses (steps {checkpoint_at}..{checkpoint_at + len(got) - 1}) "
                     "are the reference's, bit for bit")
    else:
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        lines.append(f"DIFFERENT: the resumed run started at step {resumed['first_step']} and its losses differ "
                     f"from the reference's first at step {checkpoint_at + first} ({len(got)} vs {len(want)} steps)")
    same_mix = ref["stats"]["phases"] == resumed["stats"]["phases"]
    lines.append("the realized mixture per phase is identical too" if same_mix
                 else "the realized mixture per phase DIFFERS between the runs")
    return ok and same_mix, lines


def report(cfg, ref, resumed: dict[str, Any], out_dir: Path, ok: bool, lines: list[str], total_s: float) -> list[str]:
    ckpt = Path(ref.checkpoint)
    tokens_per_s = ref.tokens / max(ref.seconds, 1e-9)
    out = [
        "",
        "== streamforge demo ==",
        f"training   {len(ref.losses)} steps, {ref.tokens:,} tokens in {ref.seconds:.1f} s: "
        f"{tokens_per_s / 1e3:.1f}k tokens/s ({len(ref.losses) / max(ref.seconds, 1e-9):.1f} steps/s); "
        f"waiting for data {ref.data_wait_s / max(ref.seconds, 1e-9):.1%} of the time",
        f"loss       {ref.losses[0]:.3f} at step 0, {ref.losses[cfg.checkpoint_at - 1]:.3f} at the checkpoint, "
        f"{ref.losses[-1]:.3f} at step {len(ref.losses) - 1}",
        "mixture    realized share of tokens (weight) per phase, from loader.stats()['phases']:",
    ]
    phases = ref.stats["phases"]
    for i, phase in enumerate(phases):
        end = phases[i + 1]["first_step"] - 1 if i + 1 < len(phases) else cfg.steps - 1
        shares = "  ".join(f"{name} {phase['shares'][name]:.3f} ({phase['weights'][name]:.2f})" for name in phase["shares"])
        out.append(f"           phase {phase['phase']} (steps {phase['first_step']}-{end}): {shares}")
    out += [
        f"resume     {ckpt} ({ckpt.stat().st_size / 1024:.0f} KiB: model, optimizer, loader state); the new "
        f"process had its first batch {resumed['resume_latency_s']:.2f} s after it started loading, "
        f"{resumed['process_s']:.1f} s in all with imports",
        *(f"verdict    {line}" for line in lines),
    ]
    png = plot(cfg, ref, resumed, out_dir / "demo.png")
    out.append(f"plot       {png}" if png else "plot       not drawn (pip install matplotlib)")
    out.append(f"total      {total_s:.1f} s")
    return out


def plot(cfg, ref, resumed: dict[str, Any], path: Path) -> Path | None:
    """Left: both loss curves. Right: realized share against weight, per stream and phase."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    left.plot(range(len(ref.losses)), ref.losses, color="0.3", linewidth=1.6, label="reference run")
    first = resumed["first_step"]
    left.plot(range(first, first + len(resumed["losses"])), resumed["losses"], color="tab:orange",
              linewidth=0.9, linestyle="--", label="resumed in a new process")
    left.axvline(cfg.checkpoint_at, color="tab:red", linewidth=0.8, linestyle=":")
    left.text(cfg.checkpoint_at, max(ref.losses), " checkpoint", color="tab:red", fontsize="small", va="top")
    for step, _ in cfg.schedule[1:]:
        left.axvline(step, color="tab:blue", linewidth=0.8, linestyle=":")
        left.text(step, max(ref.losses) * 0.93, " mixture switch", color="tab:blue", fontsize="small", va="top")
    left.set_xlabel("step")
    left.set_ylabel("training loss")
    left.legend(loc="upper right", fontsize="small")
    left.set_title("loss: the resumed curve lies on the reference")
    phases = ref.stats["phases"]
    names = list(phases[0]["shares"])
    width = 0.8 / len(phases)
    for i, phase in enumerate(phases):
        xs = [j + (i - (len(phases) - 1) / 2) * width for j in range(len(names))]
        right.bar(xs, [phase["shares"][n] for n in names], width, label=f"phase {phase['phase']} (from step {phase['first_step']})")
        right.scatter(xs, [phase["weights"][n] for n in names], color="black", marker="_", s=200, zorder=3)
    right.set_xticks(range(len(names)), names)
    right.set_ylabel("share of tokens")
    right.set_title("realized mixture per phase (- = weight)")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def progress_disabled() -> bool:
    """True where STREAMFORGE_NO_PROGRESS is set: the demo's progress bars stay off."""
    return bool(os.environ.get("STREAMFORGE_NO_PROGRESS"))
