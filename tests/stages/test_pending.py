"""From a worker's live stages, consumed and pending records are known exactly."""

import numpy as np

from pipeline_helpers import dataset, random_docs, write_stream
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
    reader = buffer.reader
    unread = {(s, r) for i, (s, a, b) in enumerate(reader.ranges[reader.range_idx:])
              for r in range(a + (reader.offset if i == 0 else 0), b)}
    manifest = Manifest.load(url)
    every = {(s, r) for s, n in enumerate(manifest.columns["num_records"].tolist()) for r in range(n)}
    partial = emitted & pending  # the document cut at the end of the last batch
    assert len(partial) <= 1 and buffer.token_offset > 0 or not partial
    assert (emitted | pending | unread) == every
    assert not (emitted - partial) & pending and not emitted & unread and not pending & unread
