"""The attention cost model: a row's cost is the sum over its document pieces, from doc_ids."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.pipeline import dataset, loader, make_corpus, take
from streamforge.errors import ConfigError
from streamforge.pipeline.cost import AttentionCost


def _row_ids(pieces, seq_len):
    """doc_ids of a row holding ``pieces`` (lengths) from position 0, padding after."""
    ids = np.full(seq_len, -1, np.int64)
    at = 0
    for d, length in enumerate(pieces):
        ids[at:at + length] = d
        at += length
    return ids


@st.composite
def rows_of_pieces(draw):
    seq_len = draw(st.integers(1, 300))
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        room, pieces = seq_len, []
        while room and draw(st.booleans()):
            length = draw(st.integers(1, room))
            pieces.append(length)
            room -= length
        rows.append(pieces)
    return seq_len, rows


@settings(max_examples=200, deadline=None)
@given(rows_of_pieces(), st.one_of(st.none(), st.integers(1, 400)), st.sampled_from([0.0, 0.5, 3.0]))
def test_row_cost_is_the_sum_over_its_pieces(case, window, linear):
    seq_len, rows = case
    cost = AttentionCost(window=window, linear=linear)
    ids = np.stack([_row_ids(p, seq_len) for p in rows])
    expected = [sum(L * min(L, window or L) + linear * L for L in pieces) for pieces in rows]
    assert np.allclose(cost.rows(ids), expected)
    assert cost.batch(ids) == pytest.approx(sum(expected))


def test_costs_of_real_batches_match_their_pieces(tmp_path):
    """On the loader's own batches (concat and bestfit), the cost from doc_ids equals the
    one from the pieces each row holds (a document cut at a row start is two pieces)."""
    corpus = make_corpus(tmp_path, np.random.default_rng(3))
    cost = AttentionCost()
    for packing in ("concat", "bestfit"):
        for batch in take(loader(dataset(corpus, seq_len=96, packing=packing), batch_size=4), 6):
            doc_ids = batch["doc_ids"].numpy()
            for row, ids in zip(cost.rows(doc_ids), doc_ids):
                lengths = np.bincount(ids[ids >= 0])
                assert row == float((lengths.astype(np.float64) ** 2).sum())
            assert cost.batch(batch["doc_ids"]) == float(cost.rows(doc_ids).sum())


def test_one_long_document_costs_more_than_many_short_ones():
    seq_len = 8192
    one = _row_ids([8192], seq_len)
    many = _row_ids([128] * 64, seq_len)
    assert AttentionCost().batch(one) == 8192 ** 2
    assert AttentionCost().batch(many) == 64 * 128 ** 2
    assert AttentionCost(window=128).batch(one) == 8192 * 128


@pytest.mark.parametrize("kwargs, match", [
    ({"window": 0}, "window"), ({"window": 2.5}, "window"), ({"window": True}, "window"),
    ({"linear": -1.0}, "linear"), ({"linear": float("nan")}, "linear"),
])
def test_bad_cost_settings_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AttentionCost(**kwargs)


def test_gpu_attention_cost_tool_runs_at_toy_size_on_cpu(capsys):
    """The GPU tool's own code (packing, balancing, timing, the fit) on CPU, eagerly."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gpu_attention_cost

    assert gpu_attention_cost.main(["--device", "cpu", "--seq-len", "256", "--batches", "8", "--heads", "1",
                                    "--head-dim", "8", "--repeats", "1", "--ranks", "4"]) == 0
    out = capsys.readouterr().out
    assert "concat" in out and "balanced" in out and "pooled" in out


def test_gpu_balance_tool_runs_at_toy_size_on_cpu(capsys):
    """tools/gpu_balance.py's own code (concat and balanced batches per rank, timing, the
    figures) on CPU, eagerly; its doc-id batches cost what the packer's rows cost."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gpu_balance

    assert gpu_balance.main(["--device", "cpu", "--seq-len", "256", "--ranks", "2", "--steps", "2", "--batch", "1",
                             "--heads", "1", "--head-dim", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "concat" in out and "balance" in out and "straggler measured" in out
    lengths = gpu_balance.document_lengths(3000, seed=0)
    batches = gpu_balance.concat_batches(lengths, 256, 2, 3)
    assert [b.shape for b in batches] == [(2, 256)] * 3 and all((b >= 0).all() for b in batches)
