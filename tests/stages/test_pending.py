"""From a worker's live stages, consumed and pending records are known exactly."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.pipeline import dataset, random_docs, write_stream
from streamforge import Manifest


def test_consumed_pending_and_unread_partition_the_pass(tmp_path, rng):
    url = str(tmp_path / "web")
    docs = write_stream(url, random_docs(rng, 400, 40, min_len=1))
    ds = dataset({"web": (url, docs)}, seq_len=32, shuffle_buffer=50)
    pipeline = ds.make_pipeline(0, 1)
    emitted = set()
    for _ in range(60):
        rows = pipeline.next_batch(2)
        emitted |= set(zip(rows.shard.tolist(), rows.record.tolist()))
    buffer = pipeline.buffers[0]
    pending = set(buffer.pending_records())
    reader = buffer.source
    unread = {(s, r) for i, (s, a, b) in enumerate(reader.ranges[reader.range_idx:])
              for r in range(a + (reader.offset if i == 0 else 0), b)}
    manifest = Manifest.load(url)
    every = {(s, r) for s, n in enumerate(manifest.columns["num_records"].tolist()) for r in range(n)}
    partial = emitted & pending  # the document cut at the end of the last batch
    assert len(partial) <= 1 and buffer.token_offset > 0 or not partial
    assert (emitted | pending | unread) == every
    assert not (emitted - partial) & pending and not emitted & unread and not pending & unread


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2**33)), unique=True, max_size=40),
       st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2**33)), max_size=40), st.randoms())
def test_locate_finds_each_wanted_record_or_says_it_is_missing(have, extra, rnd):
    from streamforge.stages.window_reads import locate

    rnd.shuffle(have)
    wanted = [k for k in have if rnd.random() < 0.7] + extra
    arr = lambda pairs, i: np.array([p[i] for p in pairs], np.int64)  # noqa: E731
    at, present = locate(arr(have, 0), arr(have, 1), arr(wanted, 0), arr(wanted, 1))
    for k, i, ok in zip(wanted, at.tolist(), present.tolist()):
        assert ok == (k in have)
        if ok:
            assert have[i] == k
