"""streamforge next to the loaders users would otherwise pick, on one synthetic corpus.

    python tools/bench_peers.py [--tokens 50e6 500e6] [--repeats 3] [--systems ...]
                                [--large-systems ...] [--workers 0 2]
                                [--backends local s3 s3-latency] [--latency-ms 25] [--bandwidth-mbps 100]
                                [--no-growth] [--no-write]

Needs the ``bench`` extra (``make venv-bench``: Grain and array-record, LitData, MosaicML
Streaming, WebDataset, torchdata, psutil, moto); a peer that is not installed or does not run is
reported with the reason, never dropped.

1. Corpus (per ``--tokens`` size, built once under ``bench-out/peers/``): lognormal document
   lengths (median 600, sigma 1.0), ids ``zipf(1.3) % 50256``, each document followed by EOS
   50256, as one flat uint16 file; then each system writes it in its own format with its own
   writer, 16 MiB shards/chunks/files: streamforge (``ShardWriter``, tar/zstd), Grain
   (``ArrayRecordWriter``, one record per document), LitData (``litdata.optimize`` with
   ``TokensLoader``, zstd and uncompressed), MosaicML Streaming (``MDSWriter``, one sample per
   2049-token block) and WebDataset (``wds.ShardWriter``, one sample per 2049-token block).
2. The job: one pass of packed 2049-token int64 blocks in batches of 8. streamforge hands out
   its full batch contract (``seq_len=2048``: input_ids, labels, position_ids, doc_ids,
   source_ids); the peers hand out bare ``[8, 2049]`` int64 token blocks. Every system
   shuffles with its own mechanism, seeded; Grain is built as torchtitan builds it
   (``tools/peers/loaders_grain.py``). streamforge also runs at equal output
   (``fields=("input_ids", "labels")``) and WebDataset's settings, for the memory comparison.
3. Each case runs in a fresh process (``--child``) and reports tokens/s (corpus tokens
   delivered over the seconds from building the loader to the end of the pass), time to
   first batch, CPU-seconds of the process tree (user + sys, the case process and its
   workers, the S3 server excluded) and peak RSS summed over the tree (sampled every 50 ms
   by this process with psutil, until the case prints its result), with 0 and 2 workers,
   from local disk and from a moto S3 server this tool starts on 127.0.0.1 (and stops, by
   its pid), read through a proxy of its own (``tools/peers/latency_proxy.py``, in another
   child, stopped the same way) that counts requests and bytes (requests per GB read):
   ``s3`` adds nothing, ``s3-latency`` adds ``--latency-ms`` before each response and caps
   each connection at ``--bandwidth-mbps``.
   Three ceilings run from local disk: packing the flat ``np.memmap`` into the same blocks,
   building streamforge's full batch contract (all five tensors) from it in file order, and
   raw zstd decoding of streamforge's shards.
4. Resume, with each system's own mechanism (streamforge ``state_dict``; Grain's iterator
   ``get_state``/``set_state``; LitData's and Mosaic's ``StreamingDataLoader`` state;
   WebDataset through torchdata's ``StatefulDataLoader``): states saved at 10%, 50%, 90% of an
   uninterrupted pass; a fresh process builds the loader, loads the state and takes the first
   batch (timed), then checks the next ``--resume-check`` batches against the uninterrupted
   pass's.
5. streamforge alone, how the cost grows (``growth``): tokens/s and RSS against shard size,
   number of streams and shuffle buffer; time to first batch against shards in the manifest.

The smallest ``--tokens`` size is the main table, with resume and the targets of issue #39
(``tools/peers/targets.py``); each larger size (10x: start-up against steady state) measures
``--large-systems`` only (default: all), and a system left out there is named with its pass
time at the main size. Medians of ``--repeats`` runs with min-max; ratios to streamforge. The
``peers`` and ``growth`` sections of docs/benchmarks.md and docs/img/peers_*.png, growth.png are
rewritten.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
TOOLS = os.path.join(ROOT, "tools")
sys.path.insert(0, ROOT)
sys.path.insert(0, TOOLS)

# the jobs live in tools/peers/ (corpus, loaders, loaders_grain, latency_proxy, child, harness,
# measure, report, targets, growth, cli);
# the corpus helpers stay importable from here (tools/soak_memory.py uses them)
from peers import cli  # noqa: E402
from peers.corpus import dir_bytes, ensure_flat, save_meta, write_streamforge  # noqa: E402

__all__ = ["dir_bytes", "ensure_flat", "main", "save_meta", "write_streamforge"]


def main(argv=None) -> int:
    return cli.main(argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
