"""tools/bench_peers.py by job: streamforge next to Grain, LitData, MosaicML Streaming and WebDataset.

- ``settings``: the fixed figures of the comparison (corpus, block, batch, systems, their names).
- ``corpus``: the synthetic corpus as one flat file, and each system's copy written by its own writer.
- ``workarounds``: what a peer needs to run here at all (LitData's index check; the torch pin of the peers' venv).
- ``loaders``: one function per system that builds its loader, and ``Case`` around it.
- ``loaders_grain``: Grain as torchtitan builds it, its ArrayRecord writer and its adapter.
- ``latency_proxy``: the proxy between the loaders and moto (time to first byte, per-connection
  bandwidth cap, request and byte counts), in a child process of its own.
- ``child``: what one fresh process measures: a pass, a resume, a ceiling, a writer.
- ``harness``: running a case in a fresh process, its CPU time and peak RSS.
- ``measure``: the cases of a corpus size, repeated and interleaved, and resume.
- ``report``: the tables, the docs/benchmarks.md section and the plot.
- ``targets``: the targets of issue #39, each measured in the run, met or missed.
- ``growth``: streamforge alone, how the cost grows with shards, streams and the buffer.
- ``cli``: the command line (``tools/bench_peers.py`` is its entry point).

Every module expects ``tools/`` and the checkout's root on ``sys.path``, as
``tools/bench_peers.py`` sets them.
"""
