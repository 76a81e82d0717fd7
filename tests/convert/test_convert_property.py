import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.convert import assert_same_docs, read_stream, write_megatron
from streamforge.convert import convert
from streamforge.format.tar import record_nbytes, records_nbytes
from streamforge.format.writer import encode_shard, encode_shard_flat

lengths_st = st.lists(st.integers(0, 700) | st.just(0), min_size=1, max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=lengths_st, shard_kib=st.integers(1, 32), frame_kib=st.integers(1, 8), seed=st.integers(0, 99))
def test_megatron_round_trip(lengths, shard_kib, frame_kib, seed):
    rng = np.random.default_rng(seed)
    if sum(lengths) == 0:
        lengths[0] = 1
    docs = [rng.integers(0, 50257, size=n).astype(np.uint16) for n in lengths]
    tmp = tempfile.mkdtemp()
    try:
        prefix = write_megatron(f"{tmp}/c", docs)
        m = convert("megatron", prefix, f"{tmp}/out", shard_size=shard_kib << 10,
                    frame_size=frame_kib << 10)
        manifest, records = read_stream(f"{tmp}/out")
        assert_same_docs(records, docs)
        assert m.num_records == len(docs) and manifest.num_tokens == sum(lengths)
    finally:
        shutil.rmtree(tmp)


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, frame=st.integers(600, 20000), first=st.integers(0, 10**9),
       wide=st.booleans())
def test_columnar_encoder_matches_record_encoder(lengths, frame, first, wide):
    dtype = np.dtype("<u4" if wide else "<u2")
    rng = np.random.default_rng(len(lengths))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(0, 60000, size=int(offsets[-1])).astype(dtype)
    records = [(first + i, tokens[offsets[i] : offsets[i + 1]], None) for i in range(len(lengths))]
    slow = encode_shard(records, frame_size=frame)
    fast = encode_shard_flat(tokens, offsets, first, frame_size=frame)
    assert b"".join(slow.parts) == b"".join(fast.parts) and slow.row == fast.row
    assert records_nbytes(lengths, dtype.itemsize).tolist() == [
        record_nbytes(n, dtype.itemsize, None) for n in lengths
    ]
