"""Property tests: whatever ShardWriter writes, the readers give back, whole or in slices."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.format import same_docs, write_stream
from streamforge.format.writer import encode_meta
from streamforge.source import ShardSource, read_records

# Each example writes a real stream to disk: ~10 ms; 100 examples keep the file under 5 s.
SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def corpora(draw, max_docs=24, max_len=80):
    """Documents (zero-length ones included), optional metadata and writer parameters.

    Shard and frame sizes go down to 1 byte, i.e. one record per shard or per frame.
    """
    token_dtype = draw(st.sampled_from(["uint16", "uint32"]))
    lengths = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=max_docs))
    # Hypothesis draws the shape; numpy fills the tokens (drawing every id would be slow).
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    high = np.iinfo(token_dtype).max + 1
    docs = [rng.integers(0, high, size=n, dtype=np.int64) for n in lengths]
    metas = [None] * len(docs)
    if draw(st.booleans()):
        metas = draw(
            st.lists(
                st.none() | st.fixed_dictionaries({"id": st.integers(0, 10**9), "text": st.text(max_size=40)}),
                min_size=len(docs),
                max_size=len(docs),
            )
        )
    params = {
        "token_dtype": token_dtype,
        "shard_size": draw(st.integers(1, 6000)),
        "frame_size": draw(st.integers(1, 3000)),
        "compression_level": draw(st.sampled_from([1, 3])),
    }
    return docs, metas, params


def _write(tmp, docs, metas, params):
    url = f"{tmp}/stream"
    return url, write_stream(url, docs, metas, **params)


@SETTINGS
@given(corpora())
def test_round_trip_through_read_records_and_source(corpus):
    docs, metas, params = corpus
    with tempfile.TemporaryDirectory() as tmp:
        url, manifest = _write(tmp, docs, metas, params)
        assert manifest.num_records == len(docs)
        assert manifest.num_tokens == sum(d.size for d in docs)
        assert manifest.token_dtype == params["token_dtype"]
        if params["shard_size"] == 1:
            assert manifest.num_shards == len(docs)

        got = [doc for s in range(manifest.num_shards) for doc in read_records(url, s)]
        assert same_docs(got, docs)
        assert all(doc.dtype == np.dtype(params["token_dtype"]) for doc in got)

        source = ShardSource.open(url)
        for shard, info in enumerate(manifest.shards):
            batch = source.read(shard, 0, info.num_records)
            first = info.first_record
            assert same_docs([batch.doc(i) for i in range(len(batch))], docs[first : first + len(batch)])
            assert batch.shard.tolist() == [shard] * len(batch)
            assert batch.record.tolist() == list(range(info.num_records))
            for r in range(info.num_records):
                assert source.read_meta(shard, r) == encode_meta(metas[first + r])


@SETTINGS
@given(corpora(max_docs=30), st.data())
def test_random_access_equals_the_slice(corpus, data):
    docs, metas, params = corpus
    with tempfile.TemporaryDirectory() as tmp:
        url, manifest = _write(tmp, docs, metas, params)
        source = ShardSource.open(url)
        for _ in range(3):
            shard = data.draw(st.integers(0, manifest.num_shards - 1), label="shard")
            info = manifest.shards[shard]
            start = data.draw(st.integers(0, info.num_records), label="start")
            stop = data.draw(st.integers(start, info.num_records), label="stop")
            index = source.index(shard)  # cached from here on
            requests = source.fetcher.stats.requests
            fetched = source.fetcher.stats.bytes_fetched
            batch = source.read(shard, start, stop)
            expected = docs[info.first_record + start : info.first_record + stop]
            assert same_docs([batch.doc(i) for i in range(len(batch))], expected)
            assert batch.lengths.tolist() == [d.size for d in expected]
            # At most one ranged request, for no more than the frames holding the records.
            assert source.fetcher.stats.requests - requests <= (1 if stop > start else 0)
            if stop > start:
                first_frame = int(index.frame_of_record(start))
                stop_frame = int(index.frame_of_record(stop - 1)) + 1
                lo, hi = index.byte_range(first_frame, stop_frame)
                assert source.fetcher.stats.bytes_fetched - fetched <= hi - lo
            partial = list(read_records(url, shard, start, stop))
            assert same_docs(partial, expected)


def test_zero_length_documents_keep_their_record_index(tmp_path):
    docs = [np.array([], np.int64), np.array([7, 8]), np.array([], np.int64), np.array([9])]
    url = str(tmp_path / "s")
    manifest = write_stream(url, docs)
    assert manifest.num_records == 4 and manifest.num_tokens == 3
    got = list(read_records(url, 0))
    assert [d.tolist() for d in got] == [[], [7, 8], [], [9]]
    batch = ShardSource.open(url).read(0, 0, 4)
    assert batch.lengths.tolist() == [0, 2, 0, 1]


def test_read_outside_the_shard_raises_index_error(small_stream):
    url, _, _, manifest = small_stream
    source = ShardSource.open(url)
    n = manifest.shards[0].num_records
    with pytest.raises(IndexError, match=manifest.shard_names[0]):
        source.read(0, 0, n + 1)
    with pytest.raises(IndexError, match="shard 99"):
        list(read_records(url, 99))


def test_a_read_around_the_last_decoded_frame_is_one_request():
    docs = [np.array([], np.int64)] * 3
    params = {"token_dtype": "uint16", "shard_size": 3072, "frame_size": 1, "compression_level": 1}
    with tempfile.TemporaryDirectory() as tmp:
        url, _ = _write(tmp, docs, [None] * 3, params)
        source = ShardSource.open(url)
        source.index(0)
        source.read(0, 0, 2)  # leaves frame 1 decoded
        before = source.fetcher.stats.requests
        assert len(source.read(0, 0, 3)) == 3
        assert source.fetcher.stats.requests - before == 1
