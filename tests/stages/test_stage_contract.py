"""Every stage keeps the stage contract: save at any position, restore into a fresh stage, and
the same output follows (``contract.run_test_save_load_state``), against an in-memory source."""

from __future__ import annotations

import numpy as np
import pytest

from contract import run_test_save_load_state
from streamforge.errors import ConfigError, ResumeMismatchError
from streamforge.format.reader import DocBatch
from streamforge.planning.schedule import MixtureSchedule
from streamforge.stages.base import Stage
from streamforge.stages.interleave import Interleaver
from streamforge.stages.pack import Packer
from streamforge.stages.read import ShardReader
from streamforge.stages.shuffle import ShuffleBuffer

EOS = 1
PER_FRAME = 3  # records in a frame of the in-memory shards


class _Index:
    """A shard's record index: token counts and which frame holds each record."""

    def __init__(self, lengths: list[int]) -> None:
        self.num_records = len(lengths)
        self.records = {"num_tokens": np.asarray(lengths, np.int64)}
        self.frames = {"first_record": np.arange(0, self.num_records, PER_FRAME)}
        self.first_records = self.frames["first_record"]

    def frame_of_record(self, record):
        return np.asarray(record) // PER_FRAME

    def record_stop(self, frame: int) -> int:
        return min(self.num_records, (frame + 1) * PER_FRAME)


class MemorySource:
    """What the stages need of a ``ShardSource``, over documents held in memory: ``dtype``,
    ``manifest`` (None: nothing is cached by it), ``index``, ``read``, ``where``, ``on_error``
    and ``close``. Token values encode (stream, shard, record, position), so any mix-up shows."""

    dtype = np.dtype("<u2")
    manifest = None

    def __init__(self, stream: int, shard_lengths: list[list[int]], on_error: str = "raise") -> None:
        self.on_error = on_error
        self.docs = [
            [(np.arange(n) + 7 * r + 100 * s + 1000 * stream + 2) % 60000 for r, n in enumerate(lengths)]
            for s, lengths in enumerate(shard_lengths)
        ]
        self.indexes = [_Index(lengths) for lengths in shard_lengths]
        self.closed = False

    def index(self, shard: int) -> _Index:
        return self.indexes[shard]

    def read(self, shard: int, start: int, stop: int) -> DocBatch:
        docs = [d.astype(self.dtype) for d in self.docs[shard][start:stop]]
        lengths = [len(d) for d in docs]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate(docs) if docs else np.zeros(0, self.dtype)
        return DocBatch(tokens, offsets, np.full(len(docs), shard, np.int64), np.arange(start, stop, dtype=np.int64))

    def where(self, shard: int, frame=None, records=None) -> str:
        return f"memory/shard-{shard}"

    def close(self) -> None:
        self.closed = True


def _lengths(seed: int, shards: int, records: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(shards):
        lengths = rng.integers(1, 30, records)
        lengths[rng.random(records) < 0.1] = 0  # empty records are passed over
        out.append(lengths.tolist())
    return out


def _ranges_for(pass_idx: int) -> list[tuple[int, int, int]]:
    """Each pass reads the shards in another order, one range cut short."""
    ranges = [(0, 0, 14), (1, 2, 13), (2, 0, 9)]
    return ranges[::-1] if pass_idx % 2 else ranges


def _reader(stream: int = 0, *, infinite: bool = False, on_error: str = "raise") -> ShardReader:
    source = MemorySource(stream, _lengths(stream, 3, 14), on_error)
    return ShardReader(source, ranges_for=_ranges_for, stream_key=f"s{stream}", infinite=infinite)


def _buffer(stream: int = 0, *, size: int = 8, warmup: int = 0, eos: bool = True, infinite: bool = False,
            on_error: str = "raise", windows_for=None) -> ShuffleBuffer:
    return ShuffleBuffer(_reader(stream, infinite=infinite, on_error=on_error), size=size, seed=5,
                         stream_key=f"s{stream}", global_worker=1, eos_id=EOS if eos else None,
                         windows_for=windows_for, warmup=warmup)


def _interleaver(weights=(0.5, 0.3, 0.2), **kw) -> Interleaver:
    buffers = [_buffer(i, size=6 + i, **kw) for i in range(len(weights))]
    return Interleaver(buffers, MixtureSchedule.build([b.stream_key for b in buffers], list(weights)))


def _run(run) -> tuple:
    """A DocRun as a comparable value."""
    streams = None if run.streams is None else run.streams.tolist()
    return (run.tokens.tolist(), run.shard.tolist(), run.record.tolist(), run.token_start.tolist(),
            run.length.tolist(), run.done, streams)


def _rows(batch) -> tuple:
    return tuple(np.asarray(getattr(batch, f)).tolist() for f in batch.__dataclass_fields__)


# -- ShardReader -------------------------------------------------------------------------------

def _doc(reader: ShardReader) -> tuple:
    doc = next(reader)
    return int(doc.shard[0]), int(doc.record[0]), doc.tokens.tolist()


@pytest.mark.parametrize("infinite", [False, True])
def test_reader_restores_at_every_document(infinite):
    out = run_test_save_load_state(lambda: _reader(infinite=infinite), _doc, limit=90)
    if not infinite:
        assert [(s, r) for s, r, _ in out] == [(s, r) for s, a, b in _ranges_for(0) for r in range(a, b)]


# -- ShuffleBuffer -----------------------------------------------------------------------------

def _chunks(n: int, max_docs: int):
    """Pull runs of up to ``n`` tokens from ``max_docs`` documents: saves inside a document."""

    def pull(buffer: ShuffleBuffer) -> tuple:
        if buffer.remaining() is None:
            raise StopIteration
        return _run(buffer.take_run(n, max_docs))

    return pull


@pytest.mark.parametrize("on_error", ["raise", "skip"])  # a restore reads as documents leave, or at once
@pytest.mark.parametrize("eos", [True, False])
@pytest.mark.parametrize("warmup", [0, 2])
def test_buffer_restores_at_every_document(on_error, eos, warmup):
    make = lambda: _buffer(eos=eos, warmup=warmup, on_error=on_error)  # noqa: E731
    out = run_test_save_load_state(make, lambda b: _run(next(b)))
    records = sorted((s, r) for run in out for s, r in zip(run[1], run[2]))
    source = make().source.source
    nonempty = [(s, r) for s, a, b in _ranges_for(0) for r in range(a, b) if source.indexes[s].records["num_tokens"][r]]
    assert records == sorted(nonempty)  # each non-empty document once


@pytest.mark.parametrize("n, max_docs", [(5, 1), (11, 3), (40, 8)])
def test_buffer_restores_inside_documents(n, max_docs):
    run_test_save_load_state(lambda: _buffer(warmup=2), _chunks(n, max_docs))


def test_buffer_restores_across_passes():
    run_test_save_load_state(lambda: _buffer(infinite=True), _chunks(9, 2), limit=120, every=3)


def test_buffer_restores_inside_saved_windows_rests():
    """An elastic resume's saved windows' rests come first (windows -2 and -1 of pass 0)."""
    rests = [{"ranges": [[2, 9, 14]], "key": 77, "pos": 1, "offset": 2},
             {"ranges": [[1, 0, 2], [0, 12, 14]], "key": 78, "pos": 0, "offset": 0}]
    make = lambda: _buffer(windows_for=lambda p: rests if p == 0 else [])  # noqa: E731
    out = run_test_save_load_state(make, _chunks(7, 2))
    tokens, shard, record, token_start = out[0][:4]
    assert shard[0] == 2 and 9 <= record[0] < 14 and token_start[0] == 2  # the first rest, 2 tokens in


def test_buffer_refuses_a_position_outside_its_window():
    buffer = _buffer()
    next(buffer)
    state = buffer.state_dict()
    state["pos"] = 99
    with pytest.raises(ResumeMismatchError, match="outside window"):
        _buffer().load_state_dict(state)


@pytest.mark.parametrize("kw", [{"size": 0}, {"warmup": -1}])
def test_buffer_arguments_are_checked(kw):
    with pytest.raises(ConfigError):
        _buffer(**kw)


# -- Interleaver -------------------------------------------------------------------------------

def _take_tokens(n: int):
    """Pull ``n`` tokens with ``take_run``, as the packer does, each with its (stream, shard,
    record, position). Where a run ends short of its budget is the interleaver's choice (a
    restored one learns that a stream ran out only when it asks it), so runs are not compared."""

    def pull(interleaver: Interleaver) -> tuple:
        tokens, where = [], []
        while len(tokens) < n:
            got = interleaver.take_run(n - len(tokens))
            if got is None:
                break
            stream, run = got
            tokens += run.tokens.tolist()
            streams = run.streams.tolist() if stream < 0 else [stream] * len(run.length)
            for piece in zip(streams, run.shard.tolist(), run.record.tolist(), run.token_start.tolist(),
                             run.length.tolist()):
                where += [(*piece[:3], piece[3] + i) for i in range(piece[4])]
        if not tokens:
            raise StopIteration
        return tokens, where

    return pull


def test_interleaver_restores_at_every_document():
    run_test_save_load_state(_interleaver, lambda il: (lambda s, run: (s, _run(run)))(*next(il)))


@pytest.mark.parametrize("n", [9, 23])
def test_interleaver_restores_inside_documents(n):
    run_test_save_load_state(_interleaver, _take_tokens(n))


def test_interleaver_restores_after_a_stream_runs_out():
    run_test_save_load_state(lambda: _interleaver((0.9, 0.1)), _take_tokens(13))


def test_interleaver_needs_one_weight_per_stream():
    with pytest.raises(ConfigError):
        Interleaver([_buffer()], MixtureSchedule.build(["s0", "s1"], [0.5, 0.5]))


# -- Packer ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["concat", "bestfit", "pad"])
def test_packer_restores_at_every_row(mode):
    make = lambda: Packer(_interleaver(), seq_len=16, mode=mode, pad_id=0, bestfit_window=5)  # noqa: E731
    run_test_save_load_state(make, lambda p: _rows(next(p)))


@pytest.mark.parametrize("mode", ["concat", "bestfit", "pad"])
def test_packer_rows_one_at_a_time_are_its_batches(mode):
    make = lambda: Packer(_interleaver(), seq_len=16, mode=mode, bestfit_window=5)  # noqa: E731
    batched, rows = make(), []
    while (batch := batched.next_rows(4)) is not None:
        rows += batch.tokens.tolist()
    assert rows == [row for batch in make() for row in batch.tokens.tolist()]


def test_packer_mode_is_checked():
    with pytest.raises(ConfigError, match="packing"):
        Packer(_interleaver(), seq_len=16, mode="greedy")


# -- the contract itself -----------------------------------------------------------------------

@pytest.mark.parametrize("cls", [ShardReader, ShuffleBuffer, Interleaver, Packer])
def test_every_stage_class_declares_the_contract(cls):
    assert issubclass(cls, Stage)
    assert cls.__doc__ and "Args:" in cls.__doc__ and "stage contract" in cls.__doc__


def test_every_stage_instance_satisfies_the_contract_and_closes_its_source():
    packer = Packer(_interleaver(), seq_len=16)
    stages = [packer, packer.source, *packer.source.sources, *(b.source for b in packer.source.sources)]
    assert all(isinstance(stage, Stage) for stage in stages)
    next(packer)
    packer.close()
    assert all(b.source.source.closed for b in packer.source.sources)
