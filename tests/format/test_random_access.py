"""A cold read of a few records fetches about one frame, not the shard index."""

import numpy as np

from streamforge import ShardWriter, read_records
from streamforge.format.frames import RECORD_DTYPE, frame_table_bytes
from streamforge.source import ShardSource
from streamforge.source.records import _read_few


def test_one_record_costs_about_one_frame(tmp_path, rng):
    docs = [rng.integers(1, 60000, size=int(n)).astype(np.uint16) for n in rng.integers(1, 200, size=3000)]
    url = str(tmp_path / "s")
    with ShardWriter(url, shard_size="64MiB", frame_size="16KiB") as w:
        for d in docs:
            w.write(d)
    probe = ShardSource.open(url)
    index = probe.index(0)
    for record in (0, 1499, 2999):
        cold = ShardSource.open(url)
        (tokens,) = list(_read_few(cold, 0, record, record + 1))
        assert np.array_equal(tokens, docs[record])
        frame = int(index.frame_of_record(record))
        expected = frame_table_bytes(index.num_frames) + RECORD_DTYPE.itemsize + int(index.frames["comp_size"][frame])
        assert cold.fetcher.stats.bytes_fetched == expected
        assert cold.fetcher.stats.bytes_fetched < int(probe.manifest.columns["index_bytes"][0])
    got = list(read_records(url, 0, 1234, 1240))
    assert all(np.array_equal(a, b) for a, b in zip(got, docs[1234:1240])) and len(got) == 6
