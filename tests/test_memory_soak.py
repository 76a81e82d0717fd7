"""A soak: with worker processes, the training process's memory stays flat pass after pass.

Each pass with workers builds its first batch in this process (``_head_start``) and then
forks the workers with every object frozen (``workers._start_workers``). A pipeline that is
left to the cyclic collector (its ``ShardSource`` and ``ReadAhead`` refer to each other) must
still be collected: frozen while young, it used to come back in the oldest generation without
counting towards a full collection, and each pass kept its decoder, frames and indexes for
good (issue 35, item 10: about 0.38 MiB a pass on the 50M-token corpus of
``tools/bench_peers.py``). ``tools/soak_memory.py`` runs the full soak.
"""

import os

import numpy as np
import pytest

from helpers.pipeline import loader, random_docs, write_stream
from streamforge import PackedTokenDataset, Stream

PASSES = 100
WARM_UP = 30  # passes before the first reading: allocator pools and caches fill by then
# Without the fix the process grew 0.34 MiB a pass here (each pass left its head start's
# pipeline behind: its decoded frame, decoder, indexes): 57.6 MiB over 169 passes between the
# readings, so about 23 MiB over the 69 here. With it, 0.05 MiB a pass.
MAX_GROWTH_MIB = 8.0


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm (Linux)")
def test_the_training_process_stays_flat_over_passes_with_workers(tmp_path):
    # one shard of one 256 KiB frame: a pass is ~30 batches, and the frame the head start
    # decodes is large enough that a pass left behind shows at once
    url = str(tmp_path / "web")
    write_stream(url, random_docs(np.random.default_rng(0), 300, 300, min_len=1),
                 shard_size="1MiB", frame_size="256KiB")
    ds = PackedTokenDataset(Stream(url, name="web"), seq_len=512, shuffle_buffer=32, seed=0)
    ld = loader(ds, batch_size=4, num_workers=2, device="cpu")
    steps = ld.steps_per_pass
    readings = {}
    for p in range(PASSES):
        assert sum(1 for _ in ld) == steps
        if p in (WARM_UP, PASSES - 1):
            readings[p] = _rss_mib()
    growth = readings[PASSES - 1] - readings[WARM_UP]
    assert growth < MAX_GROWTH_MIB, (
        f"the training process grew {growth:.1f} MiB from pass {WARM_UP} to pass {PASSES - 1} "
        f"({growth / (PASSES - 1 - WARM_UP):.3f} MiB a pass): {readings}"
    )
