"""The documents of many windows' rests, computed together (``probes.units_doc_tokens``), are
those ``probes.unit_doc_tokens`` gives one rest at a time: the same tokens in the same order."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streamforge.resume.probes import unit_doc_tokens, units_doc_tokens


class _Shards:
    """Record lengths of a few shards, read as a stream's index source reads them."""

    on_error = "raise"

    def __init__(self, lengths: list[np.ndarray]) -> None:
        self.lengths = lengths

    def index(self, shard: int):
        return SimpleNamespace(records={"num_tokens": self.lengths[shard]})


def _dataset(lengths, eos: bool):
    return SimpleNamespace(_index_source=lambda stream: _Shards(lengths), eos_appended=[eos],
                           planner=SimpleNamespace(names=["web"]))


def _rests(rng, lengths, count: int) -> list[dict]:
    units = []
    for _ in range(count):
        ranges = []
        for shard in rng.choice(len(lengths), size=int(rng.integers(1, 3)), replace=False).tolist():
            a = int(rng.integers(0, len(lengths[shard])))
            ranges.append([shard, a, int(rng.integers(a, len(lengths[shard]) + 1))])
        docs = int(sum((lengths[s][a:b] > 0).sum() for s, a, b in ranges))
        pos = int(rng.integers(0, docs + 1))
        stop = int(rng.integers(pos, docs + 1)) if rng.random() < 0.3 else None
        unit = {"ranges": ranges, "key": int(rng.integers(2**63)) * 2 + int(rng.integers(2)), "pos": pos,
                "offset": 0, "docs": (docs if stop is None else stop) - pos, "tokens": 0}
        if stop is not None:
            unit["stop"] = stop
        units.append(unit)
    return units


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), eos=st.booleans(), big=st.booleans())
def test_rests_computed_together_are_those_computed_one_at_a_time(seed, eos, big):
    rng = np.random.default_rng(seed)
    # big lengths leave few hash bits to order by: windows whose hashes agree there are
    # ordered one at a time (most of them, here), the others together
    scale = 2**38 if big else 50
    lengths = [np.where(rng.random(n) < 0.2, 0, rng.integers(1, scale, n)).astype(np.int64)
               for n in rng.integers(1, 700, 4).tolist()]
    dataset = _dataset(lengths, eos)
    units = _rests(rng, lengths, 12)
    for unit in units:  # an offset into its first document, as a packer's carry leaves one
        first = unit_doc_tokens(dataset, 0, unit)
        unit["offset"] = int(rng.integers(0, first[0])) if len(first) else 0
    together = units_doc_tokens(dataset, 0, units)
    for unit, tokens in zip(units, together):
        alone = unit_doc_tokens(dataset, 0, unit)
        assert tokens.dtype == alone.dtype and np.array_equal(tokens, alone), unit


def test_windows_whose_hashes_agree_are_ordered_one_at_a_time(monkeypatch):
    # a hash of a few values: most windows hold documents whose hashes agree, which a stable
    # sort orders by their index in the window, not by their tokens
    from streamforge.planning import rng as hashing

    monkeypatch.setattr(hashing, "_M2", np.uint64(1 << 63))
    rng = np.random.default_rng(7)
    lengths = [rng.integers(1, 1000, n).astype(np.int64) for n in (300, 40, 5)]
    dataset = _dataset(lengths, True)
    units = _rests(rng, lengths, 20)
    for unit, tokens in zip(units, units_doc_tokens(dataset, 0, units)):
        assert np.array_equal(tokens, unit_doc_tokens(dataset, 0, unit)), unit
