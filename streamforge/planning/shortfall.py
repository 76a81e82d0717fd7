"""Whether a finite pass can honour the mixture's weights, estimated from its plan.

In a finite pass each global worker holds a fixed number of tokens of each stream (its
ranges, and after an elastic resume its saved windows' rests). The interleaver hands out
tokens by share; a stream that runs out on a worker drops out and the others renormalize,
so from then on the weights are not honoured. ``estimate`` replays that in token space,
worker by worker, with no data read: each batch takes ``batch_size * seq_len`` tokens,
split among the streams still holding tokens by the weights of the batch's phase, and a
stream runs out when its worker's tokens are spent. The result is the step at which each
stream first runs out (on the earliest worker), and the shares the pass will realize.

A stream that runs out within the last ``TAIL`` of the pass's steps (or the last step) is
just the pass ending: every stream ends about then when the weights match the corpus. One
that runs out a little earlier but leaves every stream's share of the pass within
``SHARE_TOLERANCE`` of its target (relative, or 0.001 absolute for a tiny share) is not
worth a warning either: it is still listed in ``runs_out``, with ``honoured`` true.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .steps import batches_within, progression_cost

TAIL = 0.02  # the share of a pass's last steps in which a stream may run out unnoticed
SHARE_TOLERANCE = 0.02  # how far (relative) a realized share may sit from its target unwarned


def estimate(
    names: Sequence[str], tokens: Sequence[Sequence[int]], *, starts: Sequence[int],
    weights: Sequence[Sequence[float]], steps: int, first_step: int, workers_per_rank: int,
    tokens_per_batch: float | tuple[Sequence[int], Sequence[float]],
) -> dict[str, Any]:
    """What the pass will deliver. ``tokens[g][s]``: global worker ``g``'s tokens of stream
    ``s``; worker ``g``'s ``b``-th batch has step ``first_step + b * W + g % W``, and holds
    ``tokens_per_batch`` tokens: one number, or by step as segments ``(starts, tokens)``
    (a batch-size or sequence-length schedule, ``steps.step_costs``).

    Returns plain data: ``steps``, ``target_shares`` (the schedule's weights averaged over
    the pass's steps), ``expected_shares``, ``runs_out`` (``{stream: step}`` for every stream
    that runs out before the pass's tail) and ``honoured`` (no such stream, or none that
    moves a share off its target by more than ``SHARE_TOLERANCE``)."""
    n = len(names)
    W = max(1, workers_per_rank)
    seg_starts, seg_tokens = ((0,), (float(tokens_per_batch),)) if isinstance(tokens_per_batch, (int, float)) \
        else tokens_per_batch
    got = [0.0] * n
    runs_out: dict[str, int] = {}
    for g, held in enumerate(tokens):
        w = g % W
        batches = -(-(steps - w) // W) if steps > w else 0
        left = [float(x) for x in held]
        done = 0.0  # tokens this worker has handed out
        for p, start in enumerate(starts):
            end = starts[p + 1] if p + 1 < len(starts) else math.inf
            b0 = _batch_at(start, first_step, W, w, batches)
            b1 = _batch_at(end, first_step, W, w, batches)
            budget = progression_cost(seg_starts, seg_tokens, first_step + b0 * W + w, W, b1 - b0)
            while budget > 1e-9:
                active = [i for i in range(n) if weights[p][i] > 0 and left[i] > 1e-9]
                if not active:
                    break
                total = sum(weights[p][i] for i in active)
                until = min(left[i] * total / weights[p][i] for i in active)
                take = min(budget, until)
                for i in active:
                    part = take * weights[p][i] / total
                    got[i] += part
                    left[i] -= part
                budget -= take
                done += take
                for i in active:
                    if left[i] <= 1e-9 * max(1.0, held[i]):
                        left[i] = 0.0
                        full = int(batches_within(done, seg_starts, seg_tokens, first_step + w, W))
                        step = first_step + full * W + w
                        name = names[i]
                        runs_out[name] = min(runs_out.get(name, step), step)
    tail = steps - max(1, math.ceil(TAIL * steps))
    early = {k: v for k, v in runs_out.items() if v < first_step + tail} if steps else {}  # no step: warned apart
    total = sum(got)
    target = [0.0] * n
    for p, start in enumerate(starts):
        end = starts[p + 1] if p + 1 < len(starts) else math.inf
        span = max(0, min(end, first_step + steps) - max(start, first_step))
        for i in range(n):
            target[i] += weights[p][i] * span / steps if steps else 0.0
    expected = [v / total if total else 0.0 for v in got]
    off = any(abs(e - t) > max(SHARE_TOLERANCE * t, 0.001) for e, t in zip(expected, target))
    return {
        "steps": steps,
        "first_step": first_step,
        "target_shares": {k: round(v, 4) for k, v in zip(names, target)},
        "expected_shares": {k: round(v, 4) for k, v in zip(names, expected)},
        "runs_out": dict(sorted(early.items(), key=lambda kv: kv[1])),
        "honoured": not early or not off,
    }


def _batch_at(step: float, first_step: int, W: int, w: int, batches: int) -> int:
    """How many of worker ``w``'s batches come before global ``step`` (at most ``batches``)."""
    if step == math.inf:
        return batches
    return min(batches, max(0, math.ceil((step - first_step - w) / W)))


def describe(report: dict[str, Any]) -> str:
    """The warning's text."""
    out = ", ".join(f"stream {k!r} runs out at step {v}" for k, v in report["runs_out"].items())
    expect = ", ".join(f"{k} {v:.3f}" for k, v in report["expected_shares"].items())
    target = ", ".join(f"{k} {v:.3f}" for k, v in report["target_shares"].items())
    return (f"streamforge: the weights cannot be honoured in this finite pass of {report['steps']} steps "
            f"(from step {report['first_step']}): {out}, and the other streams take its share from then on; "
            f"expected token shares "
            f"over the pass: {expect} (the weights ask for {target}). Repeat the stream "
            "(Stream(..., repeat=k) or upsample=True), change the weights, or use infinite=True "
            "(docs/mixing.md)")
