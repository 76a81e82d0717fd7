"""The plan computed together by the ranks (``planning/shared.py``) equals the plan each rank
computes alone, bit for bit, while each rank reads only the record indexes of its own cuts.
Ranks are threads here, their gather a barrier; ``test_startup_requests.py`` runs real ones."""

import threading

import numpy as np
import pytest

from streamforge.errors import ConfigError
from test_plan_fast import _Source, _manifest
from streamforge.planning.planner import Planner


class _Share:
    """One rank's side of an in-process all-gather between ``world_size`` threads."""

    def __init__(self, rank, world_size, board, barrier, tamper=None):
        self.rank, self.world_size, self.board, self.barrier, self.tamper = rank, world_size, board, barrier, tamper

    def gather(self, part):
        if self.tamper is not None:
            part = self.tamper(self.rank, part)
        self.board[self.rank] = part
        self.barrier.wait()
        got = list(self.board)
        self.barrier.wait()
        return got


class _Counting(_Source):
    def __init__(self, lengths):
        super().__init__(lengths)
        self.read = []

    def index(self, shard):
        self.read.append(shard)
        return super().index(shard)


def _corpus(seed, shards=(60, 25, 7)):
    rng = np.random.default_rng(seed)
    return [[list(rng.lognormal(5, 1.3, int(k)).astype(int)) for k in rng.poisson(30, n)] for n in shards]


def _plans(streams, world, per_rank, fractions=None, tamper=None):
    names = [f"s{i}" for i in range(len(streams))]
    manifests = [_manifest(x) for x in streams]
    board, barrier = [None] * world, threading.Barrier(world)
    kw = dict(world_size=world, workers_per_rank=per_rank, batch_size=2, seq_len=64, packing="concat",
              eos_appended=[True] * len(streams), fractions=fractions)
    out, reads, errors = [None] * world, [None] * world, []

    def rank(r):
        sources = [_Counting(x) for x in streams]
        planner = Planner(names, manifests, seed=4, sources=sources.__getitem__)
        try:
            out[r] = planner.pass_plan(1, share=_Share(r, world, board, barrier, tamper), **kw)
        except ConfigError as exc:
            errors.append(exc)
        reads[r] = sum(len(set(s.read)) for s in sources)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone_sources = [_Counting(x) for x in streams]
    alone = Planner(names, manifests, seed=4, sources=alone_sources.__getitem__).pass_plan(1, **kw)
    return out, reads, alone, sum(len(set(s.read)) for s in alone_sources), errors


@pytest.mark.parametrize("world,per_rank", [(2, 1), (4, 3), (8, 8), (16, 4)])
@pytest.mark.parametrize("fractions", [None, [0.3, 0.5, 0.9]])
def test_shared_plan_equals_the_plan_alone_and_reads_only_own_cuts(world, per_rank, fractions):
    streams = _corpus(world * per_rank)
    plans, reads, alone, alone_reads, errors = _plans(streams, world, per_rank, fractions)
    assert not errors
    for plan in plans:
        assert plan == alone
    # each rank reads at most one index per own cut and stream (and, with fractions, the
    # shards its own trimmed ranges start inside); alone, a rank reads one per cut shard
    bound = (per_rank + 1) * len(streams) * (2 if fractions else 1)
    assert max(reads) <= bound
    if world * per_rank >= 16:
        assert alone_reads > 2 * max(reads)


def test_ranks_that_disagree_are_told_so():
    streams = _corpus(1)

    def tamper(rank, part):
        if rank == 1:
            part = dict(part, cuts=[[c + 1 for c in cuts] for cuts in part["cuts"]])
        return part

    _, _, _, _, errors = _plans(streams, 3, 2, tamper=tamper)
    assert errors and "disagree on cut" in str(errors[0])
