"""Token cuts in ``bench_plan_scale.py``: the plan with ``cuts="tokens"`` beside record cuts.

Per topology: the plan's time, each stream's token imbalance over global workers and the
share of each stream's tokens the pass drops (``PassPlan.dropped_tokens()`` split by stream:
what no worker was given, plus each worker's tokens past its batches in proportion to its
streams), the bound ``PassPlan.drop_bound()`` as a share of the pass, and the padding of the
pass's padded last step (``planning/last_step.py``) as a share of that step.
"""

from __future__ import annotations

import numpy as np

from scale_requests import dropped_shares
from streamforge.planning.last_step import padding_tokens
from streamforge.planning.token_cuts import CutSpec


def set_cuts(planner, world: int, workers: int, batch: int, seq_len: int, streams: int) -> None:
    planner.set_token_cuts(CutSpec(world, workers, batch, seq_len), [True] * streams)


def cut_figures(plan) -> dict:
    """Imbalance and dropped share per stream, overall imbalance, dropped and bound shares."""
    per = np.array(plan.stream_tokens, np.float64).T  # [s][g], tokens with EOS
    shares = dropped_shares(plan, list(per))
    whole = per.sum(axis=1) + np.array(plan.unassigned, np.float64)
    dropped = [(s * t + u) / w if w else 0.0 for s, t, u, w in zip(shares, per.sum(axis=1), plan.unassigned, whole)]
    overall = np.array(plan.tokens, np.float64)
    return {"imbalance": [float(t.max() / t.mean()) if t.mean() else 1.0 for t in per],
            "dropped": dropped, "overall": float(overall.max() / overall.mean()),
            "dropped_all": plan.dropped_tokens() / float(whole.sum()), "bound": plan.drop_bound() / float(whole.sum()),
            "dropped_tokens": plan.dropped_tokens(), "steps": plan.steps,
            "padding": padding_tokens(plan) / float(plan.world_size * plan.batch_size * plan.seq_len)}


def cut_lines(rows: list[dict], names) -> list[str]:
    if not rows or "cuts" not in rows[0]:
        return []
    out = ["Token cuts (`cuts=\"tokens\"`, `planning/token_cuts.py`): the same pass cut at token positions "
           "inside documents, every global worker holding the tokens of its batches (plus two a stream); "
           "what no full step can take goes to one more step, padded (`planning/last_step.py`), so the pass "
           "drops at most the two tokens per stream and global worker (`PassPlan.drop_bound()`). Dropped: "
           "share of each stream's tokens (with EOS) the pass drops; last step padded: the padding of the "
           "padded last step, as a share of that step (it counts in steps/pass); record cuts' figures are in "
           "the table above.", "",
           "| R x W | plan time, s (CPU s) | " + " | ".join(f"{n} max/mean (dropped)" for n in names)
           + " | overall max/mean | dropped, tokens (share) | bound (share) | steps/pass | last step padded |",
           "|" + "---|" * (7 + len(names))]
    for r in rows:
        c = r["cuts"]
        cells = [f"{v:.4f} ({d:.4%})" for v, d in zip(c["imbalance"], c["dropped"])]
        out.append(f"| {r['topology']} | {c['plan_s']:.3f} ({c['plan_cpu']:.3f}) | " + " | ".join(cells)
                   + f" | {c['overall']:.4f} | {c['dropped_tokens']:,} ({c['dropped_all']:.4%}) | {c['bound']:.4%} "
                   f"| {c['steps']:,} | {c['padding']:.1%} |")
    return out + [""]
