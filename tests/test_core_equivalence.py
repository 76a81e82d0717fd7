"""The compiled core (streamforge/pipeline/_core.c) against the numpy path, the reference: the
same batches (every tensor, its dtype and values) and the same states, on random batch layouts
(``expand``), random token grids (``fill_rows``) and whole passes in every packing mode, with
one stream and mixtures, in process and with workers; the golden batches on the numpy path
(tests/test_golden_batches.py checks them on the path the suite runs, the compiled one where
it is built); and ``stats()["core"]``."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.pipeline import dataset, loader, write_stream
from streamforge.pipeline import core
from streamforge.format.frames import RECORD_DTYPE
from streamforge.format.tar import BLOCK, encode_record, member_bytes, member_mismatch, npy_header_size_fixed
from streamforge.pipeline.batch import FIELDS, RowBatch, expand

COMPILED = core.ext  # None where the extension is not built or STREAMFORGE_NO_EXT is set
BUILT = importlib.util.find_spec("streamforge.pipeline._core") is not None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_core = pytest.mark.skipif(COMPILED is None, reason="the compiled core is not built (make ext), "
                                                         "or STREAMFORGE_NO_EXT asks for the numpy path alone")


@contextlib.contextmanager
def path(ext):
    """Run the hot loops on ``ext`` (the compiled core) or numpy (None) inside the block; forked
    workers inherit the choice."""
    saved = core.ext
    core.ext = ext
    try:
        yield
    finally:
        core.ext = saved


def assert_same_batch(a: dict, b: dict, where: str = "") -> None:
    assert list(a) == list(b), where
    for key in a:
        assert a[key].dtype == b[key].dtype, f"{where} {key}: {a[key].dtype} vs {b[key].dtype}"
        assert a[key].shape == b[key].shape, f"{where} {key}: {a[key].shape} vs {b[key].shape}"
        assert torch.equal(a[key], b[key]), f"{where} {key} differs"


# -- expand on random layouts ------------------------------------------------------------------

@st.composite
def row_batches(draw) -> RowBatch:
    """A RowBatch as the packers lay them out: pieces in order, apart, inside the batch, either
    tiling it (concat) or with padding between and after them (pad, bestfit, a pass's end);
    sometimes with what only the numpy path takes (an empty piece, column-major tokens)."""
    rows, seq_len = draw(st.integers(1, 5)), draw(st.integers(1, 40))
    size = rows * seq_len
    padded = draw(st.booleans())
    spans = draw(st.lists(st.tuples(st.integers(0, seq_len if padded else 0), st.integers(1, 2 * seq_len + 1)),
                          min_size=0 if padded else 1, max_size=12))
    starts, lengths, pos = [], [], 0
    for gap, length in spans:
        if pos + gap >= size:
            break
        starts.append(pos + gap)
        lengths.append(min(length, size - pos - gap))
        pos = starts[-1] + lengths[-1]
    if not padded and pos < size:  # the last piece runs to the batch's end
        lengths[-1] += size - pos
    if starts and draw(st.integers(0, 9)) == 0:  # an empty piece: left to numpy
        at = draw(st.integers(0, len(starts) - 1))
        starts.insert(at, starts[at])
        lengths.insert(at, 0)
    n = len(starts)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = np.dtype(draw(st.sampled_from(["<u2", "<u4"])))
    tokens = rng.integers(0, np.iinfo(dtype).max, (rows, seq_len + 1), endpoint=True).astype(dtype)
    if draw(st.integers(0, 9)) == 0:
        tokens = np.asfortranarray(tokens)  # strided rows: left to numpy
    streams = draw(st.integers(1, 4))
    return RowBatch(
        tokens=tokens,
        lookahead=rng.random(rows) < 0.5,
        start=np.array(starts, np.int64),
        length=np.array(lengths, np.int64),
        stream=rng.integers(0, streams, n).astype(np.int16),
        shard=rng.integers(0, 5, n).astype(np.int32),
        record=rng.integers(0, 100, n).astype(np.int64),
        token_start=rng.integers(0, 50, n).astype(np.int64),
        continues=rng.random(n) < 0.4,
    )


@needs_core
@settings(max_examples=400, deadline=None)
@given(batch=row_batches(), boundary=st.sampled_from(["document", "stream"]),
       fields=st.permutations(FIELDS).flatmap(lambda f: st.integers(0, len(f)).map(lambda k: tuple(f[:k]))),
       provenance=st.booleans())
def test_expand_gives_the_numpy_batch(batch, boundary, fields, provenance):
    kwargs = dict(boundary=boundary, provenance=provenance, fields=fields or FIELDS)
    with path(None):
        want = expand(batch, **kwargs)
    with path(COMPILED):
        got = expand(batch, **kwargs)
    assert_same_batch(got, want)


@needs_core
def test_expand_leaves_layouts_it_does_not_take_to_numpy():
    """Empty pieces, pieces out of order or past the batch, strided rows: False, nothing written."""
    tokens = np.arange(2 * 5, dtype=np.uint16).reshape(2, 5)
    look = np.zeros(2, bool)

    def call(start, length, toks=tokens):
        n = len(start)
        out = np.full((2, 4), 7, np.int64)
        done = COMPILED.expand(toks, look, np.array(start, np.int64), np.array(length, np.int64),
                               np.zeros(n, np.int16), np.zeros(n, bool), True, out, None, None, None, None)
        return done, out

    assert call([0, 4], [4, 4])[0] is True
    for start, length in (([0, 4], [4, 0]), ([4, 0], [4, 4]), ([0, 2], [4, 4]), ([0, 6], [4, 4]), ([-1], [3])):
        done, out = call(start, length)
        assert done is False and (out == 7).all()
    assert call([0, 4], [4, 4], np.asfortranarray(tokens))[0] is False


# -- fill_rows on random grids -----------------------------------------------------------------

@needs_core
@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 4), seq_len=st.integers(1, 30), dtype=st.sampled_from(["<u2", "<u4"]),
       sizes=st.lists(st.integers(0, 70), max_size=6), offset=st.integers(0, 120), seed=st.integers(0, 1000))
def test_fill_rows_writes_the_flat_tokens_into_the_rows(rows, seq_len, dtype, sizes, offset, seed):
    rng = np.random.default_rng(seed)
    offset = min(offset, rows * seq_len)
    parts = [rng.integers(0, 60000, n).astype(dtype) for n in sizes]
    total = sum(sizes)
    grid = np.full((rows, seq_len + 1), 9, dtype)
    want = grid.copy()
    if offset + total > rows * seq_len:
        with pytest.raises(ValueError, match="run past"):
            COMPILED.fill_rows(parts, grid, offset)
        assert (grid == 9).all()
        return
    flat = want[:, :seq_len].reshape(-1)  # a copy: written back below
    flat[offset : offset + total] = np.concatenate(parts) if parts else []
    want[:, :seq_len] = flat.reshape(rows, seq_len)
    assert COMPILED.fill_rows(parts, grid, offset) == total
    assert np.array_equal(grid, want)


@needs_core
def test_fill_rows_leaves_parts_of_another_dtype_to_numpy():
    grid = np.zeros((2, 5), np.uint16)
    for parts in ([np.ones(3, np.uint16), np.ones(2, np.uint32)], [np.ones(6, np.uint16)[::2]], [np.ones((1, 3), np.uint16)]):
        assert COMPILED.fill_rows(parts, grid, 0) is None
        assert (grid == 0).all()


@needs_core
@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 4), seq_len=st.integers(1, 30), dtype=st.sampled_from(["<u2", "<u4"]),
       spans=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 40)), max_size=6), offset=st.integers(0, 120),
       seed=st.integers(0, 1000))
def test_fill_parts_writes_the_spans_into_the_rows(rows, seq_len, dtype, spans, offset, seed):
    rng = np.random.default_rng(seed)
    offset = min(offset, rows * seq_len)
    source = rng.integers(0, 60000, 100).astype(dtype)
    starts = np.array([a for a, _ in spans], np.int64)
    lengths = np.array([n for _, n in spans], np.int64)
    grid = np.full((rows, seq_len + 1), 9, dtype)
    want = grid.copy()
    if (starts + lengths > len(source)).any():
        with pytest.raises(ValueError, match="outside"):
            COMPILED.fill_parts(source, starts, lengths, grid, offset)
        assert (grid == 9).all()
        return
    total = int(lengths.sum())
    if offset + total > rows * seq_len:
        with pytest.raises(ValueError, match="run past"):
            COMPILED.fill_parts(source, starts, lengths, grid, offset)
        assert (grid == 9).all()
        return
    flat = want[:, :seq_len].reshape(-1)  # a copy: written back below
    flat[offset : offset + total] = np.concatenate([source[a : a + n] for a, n in spans]) if spans else []
    want[:, :seq_len] = flat.reshape(rows, seq_len)
    assert COMPILED.fill_parts(source, starts, lengths, grid, offset) == total
    assert np.array_equal(grid, want)


@needs_core
@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 4), seq_len=st.integers(1, 30), dtype=st.sampled_from(["<u2", "<u4"]),
       docs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(1, 25)), min_size=1, max_size=8),
       eos=st.sampled_from([-1, 7]), pos=st.integers(0, 9), offset=st.integers(0, 30), size=st.integers(0, 150),
       filled=st.integers(0, 120), seed=st.integers(0, 1000))
def test_fill_window_copies_the_documents_the_parts_hold(rows, seq_len, dtype, docs, eos, pos, offset, size, filled,
                                                         seed):
    """``fill_window`` writes what the run's parts (each document, then its EOS) laid end to
    end hold, read straight from the frames; a run outside the window, a document outside its
    frame or a grid too small is refused before anything is written."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    frames = [rng.integers(0, 60000, 70).astype(dtype).tobytes() for _ in range(3)]
    frame = np.array([f for f, _, _ in docs], np.int64)
    start = np.array([a * dtype.itemsize for _, a, _ in docs], np.int64)
    length = np.array([n for _, _, n in docs], np.int64)
    views = [np.frombuffer(frames[f], dtype)[a : a + n] for f, a, n in docs]
    parts = [p for v in views for p in ((v, np.array([eos], dtype)) if eos >= 0 else (v,))]
    stream = np.concatenate(parts)  # the window's tokens laid end to end
    extents = length + (eos >= 0)
    ends = np.cumsum(extents)
    filled = min(filled, rows * seq_len)
    grid = np.full((rows, seq_len + 1), 9, dtype)
    args = (frames, frame, start, length, eos, pos, offset, size, grid, filled)
    outside = (start + length * dtype.itemsize > 70 * dtype.itemsize).any()
    begin = None if pos >= len(docs) or offset >= extents[pos] else int(ends[pos] - extents[pos]) + offset
    if size and (begin is None or begin + size > len(stream) or outside) or filled + size > rows * seq_len:
        with pytest.raises(ValueError, match="fill_window"):
            COMPILED.fill_window(*args)
        assert (grid == 9).all()
        return
    want = grid.copy()
    flat = want[:, :seq_len].reshape(-1)  # a copy: written back below
    if size:
        flat[filled : filled + size] = stream[begin : begin + size]
    want[:, :seq_len] = flat.reshape(rows, seq_len)
    assert COMPILED.fill_window(*args) == size
    assert np.array_equal(grid, want)


@needs_core
def test_fill_window_leaves_a_frame_without_a_buffer_to_the_parts():
    grid = np.zeros((2, 5), np.uint16)
    one = np.zeros(1, np.int64)
    assert COMPILED.fill_window([object()], one, one, one + 2, -1, 0, 0, 2, grid, 0) is None
    assert (grid == 0).all()


@needs_core
def test_a_window_read_whole_makes_no_object_per_document(tmp_path, monkeypatch):
    """A one-stream concat pass on the compiled core copies its windows' documents straight from
    the frames: no view per document is made (``Spans.views`` never runs), and the batches are
    the numpy path's, which makes them."""
    from streamforge.format.reader import Spans

    rng = np.random.default_rng(3)
    url = str(tmp_path / "s")
    corpus = {"s": (url, write_stream(url, [rng.integers(0, 900, n).tolist() for n in rng.integers(1, 90, 300)]))}
    with path(None):
        want = [{k: v.clone() for k, v in b.items()} for b in loader(dataset(corpus), batch_size=4)]
    monkeypatch.setattr(Spans, "views", lambda self, dtype: pytest.fail("a view per document was made"))
    with path(COMPILED):
        got = list(loader(dataset(corpus), batch_size=4))
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        assert all(torch.equal(a[k], b[k]) for k in b)


@needs_core
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=60), seq_len=st.integers(1, 9),
       batch_size=st.integers(1, 3), in_docs=st.booleans(), window=st.integers(2, 12),
       seed=st.integers(0, 100))
def test_a_batch_in_one_call_is_the_batch_the_runs_give(tmp_path_factory, lengths, seq_len, batch_size, in_docs,
                                                        window, seed):
    """A one-stream concat batch that one window holds is built in one compiled call
    (``Interleaver.take_block``): the same RowBatch, dtypes included, and the same state after
    it as the runs build, on random short documents (batches ending inside a document, on its
    EOS, and exactly at its end; windows ending at the token after a batch), with and without
    EOS appended and in the documents (a window with no EOS of its own)."""
    from streamforge import ShardWriter
    from streamforge.stages.interleave import Interleaver

    rng = np.random.default_rng(seed)
    url = str(tmp_path_factory.mktemp("c") / "s")
    with ShardWriter(url, shard_size="1KiB", frame_size="256B", eos_id=0, docs_end_with_eos=in_docs) as writer:
        for n in lengths:
            writer.write(np.append(rng.integers(1, 500, n), [0] * in_docs).astype(np.uint16))
    ds = dataset({"s": (url, None)}, seq_len=seq_len, shuffle_buffer=window, shuffle_warmup=0, seed=seed)
    blocks = []
    take_block = Interleaver.take_block

    def counted(self, ext, grid):
        got = take_block(self, ext, grid)
        blocks.append(got is not None)
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Interleaver, "take_block", counted)
        got = _pipeline_pass(ds, COMPILED, batch_size)
        mp.setattr(Interleaver, "take_block", lambda self, ext, grid: None)
        want = _pipeline_pass(ds, COMPILED, batch_size)
    assert len(got) == len(want) > 0
    for i, ((a, sa), (b, sb)) in enumerate(zip(got, want)):
        for field in a.__dataclass_fields__:
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and np.array_equal(x, y), f"batch {i}: {field} differs"
        assert sa == sb, f"state after batch {i}"
    assert any(blocks) or sum(lengths) < 4 * seq_len * batch_size  # the call runs wherever a window can hold a batch


@needs_core
def test_window_block_refuses_a_batch_it_cannot_lay_out():
    """``window_block`` writes nothing where a frame has no buffer (None: the runs take the
    batch), and refuses a batch running past the window or touching another number of
    documents than the pieces given, before writing."""
    frames = [np.arange(1, 21, dtype=np.uint16).tobytes()]
    frame, start, length = np.zeros(4, np.int64), np.arange(4, dtype=np.int64) * 10, np.full(4, 5, np.int64)
    ids = np.arange(4, dtype=np.int64)

    def call(rows, seq_len, docs, frames=frames, pos=0, offset=0):
        grid = np.full((rows, seq_len + 1), 9, np.uint16)
        cols = (np.empty((4, docs), np.int64), np.empty(docs, np.int32), np.empty(docs, np.int16), np.empty(docs, bool))
        got = COMPILED.window_block(frames, frame, start, length, 0, pos, offset, 0, ids, ids, grid, *cols)
        return got, grid, cols

    got, grid, (cols, shard, stream, continues) = call(2, 4, 2)  # 8 tokens of documents 0 and 1, EOS after each
    assert got is True
    assert grid.tolist() == [[1, 2, 3, 4, 5], [5, 0, 6, 7, 8]]
    assert cols.tolist() == [[0, 6], [6, 2], [0, 1], [0, 0]] and continues.tolist() == [False, True]
    assert call(2, 4, 2, frames=[object()])[0] is None
    for rows, seq_len, docs, match in ((4, 6, 4, "run past"), (2, 4, 3, "not the 3 pieces")):
        with pytest.raises(ValueError, match=match):
            _, grid, _ = call(rows, seq_len, docs)


@needs_core
def test_fill_parts_leaves_a_source_of_another_dtype_to_numpy():
    grid = np.zeros((2, 5), np.uint16)
    starts, lengths = np.array([0, 1]), np.array([1, 2])
    for source in (np.ones(6, np.uint32), np.ones(12, np.uint16)[::2]):
        assert COMPILED.fill_parts(source, starts, lengths, grid, 0) is None
        assert (grid == 0).all()


# -- member_check on damaged frames ------------------------------------------------------------

@st.composite
def frames(draw):
    """A frame's decoded bytes (records with and without a .json member) and its index rows,
    then a few bytes of the frame or fields of the rows overwritten."""
    itemsize = draw(st.sampled_from([2, 4]))
    parts, rows, at = [], [], 0
    for i, (n, meta) in enumerate(draw(st.lists(st.tuples(st.integers(0, 300), st.booleans()), min_size=1, max_size=8))):
        meta_json = b'{"k": %d}' % i if meta else None
        blobs, offset = encode_record(i, np.arange(n, dtype=f"<u{itemsize}"), meta_json)
        size = sum(len(b) for b in blobs)
        meta_at = at + size - member_bytes(len(meta_json)) + BLOCK if meta else 0
        rows.append((at + offset, n, meta_at, len(meta_json) if meta else 0))
        parts += blobs
        at += size
    raw = bytearray(b"".join(parts))
    records = np.array(rows, dtype=RECORD_DTYPE)
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):  # a byte of a header's size field, or anywhere
            i = draw(st.integers(0, len(records) - 1))
            base = int(records["token_offset"][i]) - 128 - BLOCK + 124
            pos = draw(st.one_of(st.integers(base, base + 10), st.integers(0, len(raw) - 1)))
            raw[min(max(pos, 0), len(raw) - 1)] = draw(st.sampled_from([ord("0"), ord("7"), ord("8"), ord(" "), 0]))
        else:
            field = draw(st.sampled_from(RECORD_DTYPE.names))
            i = draw(st.integers(0, len(records) - 1))
            # within the frame and a block past it, as the index checks leave them
            records[field][i] = max(0, int(records[field][i]) + draw(st.integers(-600, 600))) if draw(
                st.booleans()) else draw(st.sampled_from([0, 1, 511, 1024, len(raw), len(raw) + BLOCK]))
    return bytes(raw), records, itemsize


@needs_core
@settings(max_examples=300, deadline=None)
@given(frame=frames())
def test_member_check_finds_the_mismatch_numpy_finds(frame):
    raw, records, itemsize = frame
    head = npy_header_size_fixed(itemsize)
    got = COMPILED.member_check(raw, records["token_offset"], records["num_tokens"], records["meta_offset"],
                                records["meta_size"], head, itemsize)
    want = member_mismatch(np.frombuffer(raw, np.uint8), records, itemsize)
    assert (got if got != -1 else (-1, "", 0, None)) == want


@needs_core
def test_member_check_leaves_other_columns_to_numpy():
    z = np.zeros(2, np.int64)
    assert COMPILED.member_check(b"", np.zeros(2), z, z, z, 128, 2) is None  # float
    assert COMPILED.member_check(b"", z, z[:1], z, z, 128, 2) is None  # lengths differ
    assert COMPILED.member_check(b"", np.zeros((2, 1), np.int64), z, z, z, 128, 2) is None


# -- whole passes -------------------------------------------------------------------------------

def _pass(make_loader, ext):
    """Every batch of a pass with the state after it, and the loader's stats, on one path."""
    with path(ext):
        ldr = make_loader()
        out = [({k: v.clone() for k, v in b.items()}, ldr.state_dict()) for b in ldr]
        return out, ldr.stats()


def _assert_same_pass(got, want) -> None:
    (got, got_stats), (want, want_stats) = got, want
    assert len(got) == len(want)
    for i, ((a, sa), (b, sb)) in enumerate(zip(got, want)):
        assert_same_batch(a, b, f"batch {i}")
        assert sa == sb, f"state after batch {i}"
    assert got_stats["core"] == "compiled" and want_stats["core"] == "numpy"
    assert _counts(got_stats) == _counts(want_stats)


def _counts(stats: dict) -> dict:
    """The token and document counters of ``stats()`` (not the storage ones: timings, prefetches)."""
    out = {k: v for k, v in stats.items() if k not in ("streams", "core") and not isinstance(v, float)}
    out["streams"] = {name: (s["tokens"], s["documents"]) for name, s in stats["streams"].items()}
    return out


def _corpus(tmp, lengths, seed):
    rng = np.random.default_rng(seed)
    corpus = {}
    for i, lens in enumerate(lengths):
        if sum(lens) == 0:
            lens = lens + [3]
        docs = [rng.integers(1, 500, size=n).astype(np.uint16) for n in lens]
        url = str(tmp / f"s{i}")
        corpus[f"s{i}"] = (url, write_stream(url, docs, shard_size="1KiB", frame_size="512B"))
    return corpus


@needs_core
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.lists(st.integers(0, 150), min_size=1, max_size=25), min_size=1, max_size=3),
    seq_len=st.integers(4, 64),
    packing=st.sampled_from(["concat", "bestfit", "pad", "balance"]),
    boundary=st.sampled_from(["document", "stream"]),
    batch_size=st.integers(1, 3),
    seed=st.integers(0, 100),
)
def test_a_pass_gives_the_numpy_batches_and_states(tmp_path_factory, lengths, seq_len, packing, boundary,
                                                   batch_size, seed):
    if packing != "concat":
        boundary = "document"  # stream boundary is plain stream packing: concat only
    corpus = _corpus(tmp_path_factory.mktemp("c"), lengths, seed)

    def make():
        ds = dataset(corpus, weights=[1.0 + i for i in range(len(corpus))], seq_len=seq_len, shuffle_buffer=7,
                     packing=packing, boundary=boundary, provenance=True, bestfit_window=5, seed=seed)
        return loader(ds, batch_size=batch_size)

    _assert_same_pass(_pass(make, COMPILED), _pass(make, None))
    # a worker's pipeline to its end, short last batch included (the loader drops that one)
    got, want = (_pipeline_pass(make().dataset, ext, batch_size + 1) for ext in (COMPILED, None))
    assert len(got) == len(want)
    for i, ((a, sa), (b, sb)) in enumerate(zip(got, want)):
        for field in a.__dataclass_fields__:
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and np.array_equal(x, y), f"batch {i}: {field} differs"
        assert sa == sb, f"state after batch {i}"


def _step_schedule(name, low, high):
    """``[(0, v), (step, v), ...]``: up to three switches at increasing steps."""
    return st.lists(st.tuples(st.integers(1, 6), st.integers(low, high)), max_size=3).flatmap(
        lambda extra: st.integers(low, high).map(lambda v0: [(0, v0)] + [
            (int(s), v) for s, (_, v) in zip(np.cumsum([e[0] for e in extra]), extra)]))


@needs_core
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.lists(st.integers(0, 150), min_size=1, max_size=25), min_size=1, max_size=2),
    seq_len=_step_schedule("seq_len", 4, 48),
    batch_size=_step_schedule("batch_size", 1, 3),
    packing=st.sampled_from(["concat", "bestfit", "pad"]),
    seed=st.integers(0, 100),
)
def test_a_pass_with_schedules_gives_the_numpy_batches_and_states(tmp_path_factory, lengths, seq_len, batch_size,
                                                                  packing, seed):
    """Batch-size and seq_len schedules: the row length switches at its step on both paths
    alike (the concat rows the compiled core fills, the bestfit window laid out again)."""
    corpus = _corpus(tmp_path_factory.mktemp("c"), lengths, seed)

    def make():
        ds = dataset(corpus, weights=[1.0 + i for i in range(len(corpus))], seq_len=seq_len, shuffle_buffer=7,
                     packing=packing, provenance=True, bestfit_window=5, seed=seed)
        return loader(ds, batch_size=batch_size)

    _assert_same_pass(_pass(make, COMPILED), _pass(make, None))


def _pipeline_pass(ds, ext, batch_size: int) -> list:
    """Worker 0 of 1's RowBatches to the end of its data, each with the pipeline's state after it."""
    with path(ext):
        pipeline = ds.make_pipeline(0, 1)
        out = []
        while (rows := pipeline.next_batch(batch_size)) is not None:
            out.append((rows, repr(pipeline.state_dict())))
        return out


@needs_core
@pytest.mark.parametrize("packing", ["concat", "bestfit", "balance"])
def test_workers_and_resumes_give_the_numpy_batches(tmp_path, packing):
    """Two forked workers pack on the path their parent runs; a state saved on one path
    resumes on the other into the same batches."""
    corpus = _corpus(tmp_path, [[40, 7, 130, 0, 66] * 6, [300, 12, 90] * 4, [5] * 30], 3)

    def make(workers=2):
        ds = dataset(corpus, weights=[0.5, 0.3, 0.2], seq_len=32, packing=packing, provenance=True, seed=4)
        return loader(ds, batch_size=3, num_workers=workers)

    _assert_same_pass(_pass(make, COMPILED), _pass(make, None))
    whole, _ = _pass(lambda: make(0), COMPILED)
    at = len(whole) // 2
    for ext in (None, COMPILED):  # a state of the compiled path, resumed on both
        resumed, _ = _pass(lambda: _resumed(make(0), whole[at - 1][1]), ext)
        for i, ((a, _), (b, _)) in enumerate(zip(resumed, whole[at:])):
            assert_same_batch(a, b, f"resumed batch {i}")
        assert len(resumed) == len(whole) - at


@needs_core
def test_one_stream_workers_build_their_batches_in_one_call(tmp_path):
    """One stream and forked workers: each worker builds its batches straight into its ring
    slot in one compiled call (``window_block``) wherever a window holds the batch, and the
    batches and states are the numpy path's; a state saved mid-pass resumes into the same
    batches."""
    corpus = _corpus(tmp_path, [[40, 7, 130, 66, 300, 12, 90, 5] * 8], 5)

    def make(workers=2):
        return loader(dataset(corpus, seq_len=24, provenance=True, seed=2), batch_size=3, num_workers=workers)

    got = _pass(make, COMPILED)
    _assert_same_pass(got, _pass(make, None))
    whole, _ = got
    at = len(whole) // 2
    resumed, _ = _pass(lambda: _resumed(make(), whole[at - 1][1]), COMPILED)
    assert len(resumed) == len(whole) - at
    for i, ((a, _), (b, _)) in enumerate(zip(resumed, whole[at:])):
        assert_same_batch(a, b, f"resumed batch {i}")


def _resumed(ldr, state):
    ldr.load_state_dict(state, strict=True)
    return ldr


# -- the numpy path on the golden batches, and what stats() says --------------------------------

def test_the_numpy_path_gives_the_recorded_batches():
    env = dict(os.environ, STREAMFORGE_NO_EXT="1")
    tool = os.path.join(ROOT, "tools", "batch_digest.py")
    done = subprocess.run([sys.executable, tool, "--check", os.path.join(ROOT, "tools", "batch_digests.json")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "all 5 jobs give the same batches" in done.stderr


def test_the_environment_variable_selects_the_numpy_path():
    code = "from streamforge.pipeline import core; print(core.name())"
    for value, want in (("1", "numpy"), ("0", "compiled" if BUILT else "numpy")):
        env = dict(os.environ, STREAMFORGE_NO_EXT=value)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        assert done.stdout.strip() == want


def test_stats_say_which_path_runs(tmp_path):
    corpus = _corpus(tmp_path, [[20, 30, 40]], 0)
    for ext, want in ((None, "numpy"), (COMPILED, "compiled" if COMPILED is not None else "numpy")):
        with path(ext):
            ldr = loader(dataset(corpus, seq_len=16))
            next(iter(ldr))
            assert ldr.stats()["core"] == want
