"""``gather``: one view per record in the token dtype, whether or not the records' tokens
start at a multiple of the token size in their frames."""

import numpy as np
import pytest

from streamforge.format.frames import FRAME_DTYPE, RECORD_DTYPE, ShardIndex
from streamforge.format.reader import gather


def _shard(docs: list[list[int]], dtype, pad: int):
    """Two frames of ``docs`` (split in half), each record's tokens after ``pad`` bytes of
    filler: its index and the decoded frames."""
    dtype = np.dtype(dtype)
    half = len(docs) // 2
    frames, rows, firsts = [], [], []
    for part, first in ((docs[:half], 0), (docs[half:], half)):
        raw = bytearray()
        firsts.append(first)
        for doc in part:
            raw += b"\xee" * pad
            rows.append((len(raw), len(doc), 0, 0))
            raw += np.asarray(doc, dtype).tobytes()
        frames.append(bytes(raw))
    frame_table = np.array([(0, 0, len(f), r) for f, r in zip(frames, firsts)], FRAME_DTYPE)
    index = ShardIndex(frame_table, np.array(rows, RECORD_DTYPE), sum(map(len, docs)))
    return index, frames


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("pad", [8, 3])  # aligned; not a multiple of the token size
def test_gather_views_are_the_records_tokens(dtype, pad):
    docs = [[1, 2, 3], [], [4], [5, 6, 7, 8, 9], [10, 11], [65535]]
    index, frames = _shard(docs, dtype, pad)
    got = gather(index, frames, 0, 7, 1, 6, np.dtype(dtype))
    assert [v.dtype for v in got.views] == [np.dtype(dtype)] * 5
    assert [v.tolist() for v in got.views] == docs[1:6]
    assert got.tokens.tolist() == [t for d in docs[1:6] for t in d]
    assert got.offsets.tolist() == [0, 0, 1, 6, 8, 9]
    assert got.record.tolist() == [1, 2, 3, 4, 5] and got.shard.tolist() == [7] * 5
