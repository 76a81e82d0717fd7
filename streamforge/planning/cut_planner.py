"""The planner's token cuts (``token_cuts.py``): the ``Planner`` methods that cut passes at
token positions and count what they hold, kept apart from the record-cut planner."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .plan import PassPlan, Range, build_pass_plan, records_at, trim_ranges
from .token_cuts import CutSpec, assigned_end, cut_range_tokens, cut_stream


class TokenCutPlanning:
    """Mixed into ``Planner``: ``cut_specs`` (by number of global workers), ``cut_eos`` and the
    ``_cut`` cache are set up by its constructor."""

    def set_token_cuts(self, spec: CutSpec | None, eos_appended: Sequence[bool]) -> None:
        """Cut the passes of ``spec``'s topology at token positions (``token_cuts.py``); a
        topology without a spec is cut at record boundaries. Plans made before for another
        spec of as many global workers are dropped."""
        self.cut_eos = [bool(e) for e in eos_appended]
        if spec is None or self.cut_specs.get(spec.n) == spec:
            return
        n = spec.n
        self.cut_specs[n] = spec
        self.cut_spec = spec
        for cache in (self._ranges, self._worker_ranges):
            for key in [k for k in cache if k[2] == n]:
                del cache[key]
        for key in [k for k in self._cut if k[0] != "shard_tokens"]:
            del self._cut[key]

    def _token_cut(self, n: int) -> bool:
        return n in self.cut_specs and all(r == 1.0 for r in self.repeats)

    def cut_shard_tokens(self, stream: int) -> np.ndarray:
        """Each shard's tokens with the EOS the pipeline appends (token cuts' unit)."""
        key = ("shard_tokens", stream)
        if key not in self._cut:
            records, tokens, docs = self._columns(stream)
            if self.cut_eos[stream] and docs is None:  # a manifest without counts: from the indexes
                docs = [self.totals(stream, [(k, 0, r)])[1] for k, r in enumerate(records)]
            extra = np.asarray(docs, np.int64) if self.cut_eos[stream] else 0
            self._cut[key] = np.asarray(tokens, np.int64) + extra
        return self._cut[key]

    def cut_budgets(self, n: int) -> np.ndarray:
        """``[s][g]``: tokens of stream ``s`` global worker ``g`` of ``n`` gets under token cuts."""
        return self._cut_steps_budgets(n)[1]

    def cut_steps(self, n: int) -> int:
        """Steps of a pass cut at token positions for ``n`` global workers, the padded last
        one included (0 when infinite: the rows say)."""
        return self._cut_steps_budgets(n)[0]

    def _cut_steps_budgets(self, n: int) -> tuple[int, np.ndarray]:
        if ("budgets", n) not in self._cut:
            totals = [int(self.cut_shard_tokens(s).sum()) for s in range(len(self.names))]
            self._cut[("budgets", n)] = self.cut_specs[n].budgets(totals)
        return self._cut[("budgets", n)]

    def _plan_tokens(self, stream: int, pass_idx: int, n: int, workers: list[int] | None) -> list[list[Range]]:
        eos = self.cut_eos[stream]
        lengths = lambda shards: self.record_ends_with_eos(stream, shards, eos)  # noqa: E731
        ranges, tokens = cut_stream(self.layout(stream, pass_idx, n), self.cut_shard_tokens(stream),
                                    self.cut_budgets(n)[stream], lengths, eos, workers)
        if workers is None:
            self._cut[("tokens", stream, pass_idx, n)] = tokens
        return ranges

    def keep_cut_tokens(self, stream: int, pass_idx: int, n: int, tokens) -> None:
        """Keep every worker's tokens of a token-cut stream and pass, computed elsewhere."""
        self._cut[("tokens", stream, pass_idx, n)] = np.asarray(tokens, np.int64)

    def cut_unassigned(self, pass_idx: int, n: int) -> list[int] | None:
        """Per stream, the tokens of ``pass_idx`` that token cuts for ``n`` global workers give
        no worker (None where that topology is cut at records)."""
        if not self._token_cut(n):
            return None
        out = []
        for s in range(len(self.names)):
            eos = self.cut_eos[s]
            lengths = lambda shards, s=s, eos=eos: self.record_ends_with_eos(s, shards, eos)  # noqa: E731
            tokens = self.cut_shard_tokens(s)
            end = assigned_end(self.layout(s, pass_idx, n), tokens, self.cut_budgets(n)[s], lengths, eos)
            out.append(int(tokens.sum()) - end)
        return out

    def record_ends_with_eos(self, stream: int, shards: Sequence[int], eos: bool) -> list[np.ndarray]:
        """Running sums of each shard's record lengths, plus one per non-empty record with
        ``eos`` (``token_cuts.EndsOf``), their indexes read in parallel."""
        self.prefetch_indexes(stream, shards)
        got = [self._prefix[(stream, k)] for k in shards]
        return [tokens + docs for tokens, docs in got] if eos else [tokens for tokens, _ in got]

    def _token_pass_plan(self, pass_idx: int, n: int, fractions, args: dict) -> PassPlan:
        """``pass_plan`` under token cuts: every rank computes it alone (each reads the
        record indexes of every shard a cut falls in), counts from the cuts themselves."""
        per_stream = [self.ranges(s, pass_idx, n) for s in range(len(self.names))]
        if fractions is None:
            counted = [self._cut[("tokens", s, pass_idx, n)] for s in range(len(self.names))]
            by_id = {id(r): int(t) for s, workers in enumerate(per_stream) for r, t in zip(workers, counted[s])}
            totals = lambda s, ranges: (by_id[id(ranges)], 0)  # noqa: E731
        else:
            per_stream = [[trim_ranges(r, records_at(r, f)) for r in workers]
                          for workers, f in zip(per_stream, fractions)]
            self._prefetch_counts(per_stream)
            totals = self.cut_totals
        plan = build_pass_plan(per_stream, totals, streams=self.names, eos_appended=[False] * len(self.names), **args)
        whole = [int(self.cut_shard_tokens(s).sum()) for s in range(len(self.names))]
        if fractions is None:
            plan.unassigned = [w - sum(g[s] for g in plan.stream_tokens) for s, w in enumerate(whole)]
            if self.cut_specs[n].finite:  # the pass ends in a padded step: what no full step takes
                plan.steps, plan.last_step = self.cut_steps(n), "pad"
        plan.cuts = [[list(getattr(r, "cut", (0, 0))) for r in workers] for workers in per_stream]
        return plan

    def cut_totals(self, stream: int, ranges) -> tuple[int, int]:
        """(tokens with EOS after the cuts, 0) of token-cut ``ranges`` of a stream."""
        eos = self.cut_eos[stream]

        def whole(rs):
            t, d = self.totals(stream, rs)
            return t + (d if eos else 0)

        def record(shard, r):
            tok, docs = self._prefix_of(stream, shard)
            return int(tok[r + 1] - tok[r]) + (int(docs[r + 1] - docs[r]) if eos else 0)

        return cut_range_tokens(ranges, whole, record), 0

