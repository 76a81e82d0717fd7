"""The padded last step of a token-cut pass, on real loaders: every token of the pass once,
static shapes, at most two tokens per stream and worker dropped; and ``DropWarning`` when a
record-cut pass drops more than 1%."""

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.pipeline import dataset, loader, random_docs, take, write_stream
from streamforge import DropWarning
from streamforge.planning.last_step import padding_tokens
from test_token_cuts import _exactly_once, _pieces


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    """Two streams with heavy-tailed (Pareto) document lengths, a few empty."""
    root = tmp_path_factory.mktemp("last")
    rng = np.random.default_rng(5)
    out = {}
    for name, mean, count in (("web", 30, 150), ("books", 300, 12)):
        docs = [d[: int(rng.pareto(1.2) * mean)] for d in random_docs(rng, count, 4 * mean)]
        out[name] = (str(root / name), write_stream(str(root / name), docs, shard_size="16KiB"))
    return out


def _whole(corpus):
    return sum(len(d) + 1 for _, docs in corpus.values() for d in docs if len(d))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(world=st.integers(1, 3), workers=st.integers(0, 3), batch=st.integers(1, 3), seq_len=st.sampled_from([16, 48]))
def test_every_token_once_with_a_padded_last_step(heavy, world, workers, batch, seq_len):
    """Over random topologies: every rank has the same steps, every batch the static shape,
    padding only in the last step (counted by stats()), every token delivered once, and the
    pass drops at most two tokens per stream and global worker."""
    pieces, dropped, padding, steps = [], 0, 0, set()
    for rank in range(world):
        ldr = loader(dataset(heavy, provenance=True, rank=rank, world_size=world, seq_len=seq_len, cuts="tokens"),
                     num_workers=workers, batch_size=batch)
        plan = ldr.plan()
        batches = take(ldr)
        steps.add((len(batches), plan.steps))
        assert all(tuple(b["input_ids"].shape) == (batch, seq_len) for b in batches)
        assert all((b["doc_ids"] >= 0).all() for b in batches[:-1])
        last = batches[-1]
        pad = last["doc_ids"] < 0
        assert (last["labels"][pad] == -100).all() and (last["position_ids"][pad] == 0).all()
        stats = ldr.stats()
        assert stats["padding_tokens"] == int(pad.sum())  # the padding built
        assert ldr.plan().pass_idx == 1 and stats["pass_padding_tokens"] == padding_tokens(ldr.plan(), rank)
        pieces.append(_pieces(batches))
        dropped += stats["dropped_tokens"]
        padding += int(pad.sum())
    assert len(steps) == 1 and len({a for a, b in steps} | {b for a, b in steps}) == 1  # one clock
    delivered = _exactly_once(heavy, np.concatenate(pieces))
    assert delivered + dropped == _whole(heavy)
    assert dropped == plan.dropped_tokens() <= plan.drop_bound() == 2 * 2 * world * max(workers, 1)
    assert padding < world * batch * seq_len


def test_drop_warning_names_the_share_and_the_fix(heavy):
    """Record cuts that drop more than 1% of a finite pass warn once, before the first batch;
    token cuts do not."""
    ldr = loader(dataset(heavy, seq_len=32, world_size=2, rank=0), num_workers=3, batch_size=2)
    with pytest.warns(DropWarning, match=r"cuts='tokens'") as got:
        it = iter(ldr)
        next(it)
    (w,) = [x for x in got if issubclass(x.category, DropWarning)]
    share = ldr.stats()["pass_dropped_share"]
    assert share > 0.01 and f"{share:.2%}" in str(w.message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DropWarning)
        take(ldr)  # the rest of the pass and the next: warned once already
        take(ldr, 2)
    for cuts in ("tokens",):
        quiet = loader(dataset(heavy, seq_len=32, world_size=2, rank=0, cuts=cuts), num_workers=3, batch_size=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DropWarning)
            take(quiet, 2)
        assert quiet.stats()["pass_dropped_tokens"] <= quiet.plan().drop_bound() == 2 * 2 * 6
