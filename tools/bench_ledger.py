"""What the data-order ledger costs: loader throughput with and without ``ledger_dir``, the
writer's own time per step, the bytes it writes, and how long ``ledger check`` takes.

    python tools/bench_ledger.py [--tokens 20e6] [--repeats 5] [--out docs/benchmarks.md] [--no-write]

1. Corpus: the one ``tools/bench_pipeline.py`` builds (one stream, lognormal documents of
   median 600 tokens), under ``bench-out/ledger/``, reused while its parameters match.
2. Per repeat, in turn (machine noise hits every case alike): one pass of 8x2048 batches with
   ``StreamingLoader(num_workers=N)`` for N in 0, 2, without and with a ledger on local disk
   (default ``chunk_steps``, ``state_dict()`` every 100 steps in both, as a trainer that
   checkpoints would); non-padding tokens / seconds from ``iter()`` to the end of the pass.
   Round 0 warms caches and is not counted.
3. The writer alone: ``LedgerWriter.add`` over the pass's first ``RowBatch``es and a
   ``flush(wait=False)`` every 100 steps, in CPU time of the calling thread (what training
   pays), then with the background puts (CPU time of the whole process).
4. ``read_ledger`` + ``check`` over the pass's ledger.

Medians; figures go to the ``ledger`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_pipeline import BATCH, SEQ_LEN, ensure_corpus, real_tokens  # noqa: E402
from streamforge import PackedTokenDataset, StreamingLoader  # noqa: E402
from streamforge.ledger.store import LedgerWriter, read_ledger  # noqa: E402
from streamforge.ledger.report import check  # noqa: E402

WORKERS = (0, 2)
CHECKPOINT_EVERY = 100
M = 1e6


def make_loader(url: str, num_workers: int, ledger_dir: str | None) -> StreamingLoader:
    dataset = PackedTokenDataset(url, seq_len=SEQ_LEN, seed=0)
    return StreamingLoader(dataset, batch_size=BATCH, num_workers=num_workers, ledger_dir=ledger_dir)


def time_pass(url: str, num_workers: int, ledger_dir: str | None) -> dict:
    if ledger_dir is not None:
        shutil.rmtree(ledger_dir, ignore_errors=True)
    loader = make_loader(url, num_workers, ledger_dir)
    tokens = batches = 0
    start, cpu = time.perf_counter(), time.process_time()
    for batch in loader:
        tokens += real_tokens(batch)
        batches += 1
        if batches % CHECKPOINT_EVERY == 0:
            loader.state_dict()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "cpu": cpu, "tokens": tokens, "batches": batches}


def writer_cost(url: str, ledger_dir: str) -> dict:
    """Seconds per step in ``add`` and in ``flush`` for the pass's own batches."""
    dataset = PackedTokenDataset(url, seq_len=SEQ_LEN, seed=0)
    pipeline = dataset.make_pipeline(0, 1)
    batches = []
    try:
        while len(batches) < 2000 and (rows := pipeline.next_batch(BATCH)) is not None:
            batches.append(rows)
    finally:
        pipeline.close()
    shutil.rmtree(ledger_dir, ignore_errors=True)
    writer = LedgerWriter(ledger_dir, rank=0, world_size=1, meta={"seq_len": SEQ_LEN}, chunk_steps=10**9)
    add = flush = 0.0
    clock = time.thread_time  # CPU time of the training thread: a loaded machine's waits do not count
    everything = time.process_time()  # every thread: the background puts too
    for step, rows in enumerate(batches):
        t = clock()
        writer.add(step, 0, rows)
        add += clock() - t
        if (step + 1) % CHECKPOINT_EVERY == 0 or step + 1 == len(batches):
            t = clock()
            writer.flush(wait=False)  # as state_dict() does, but without waiting for the put
            flush += clock() - t
    writer.close()
    everything = time.process_time() - everything
    pieces = sum(len(r.start) for r in batches)
    written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ledger_dir) for f in fs)
    return {"steps": len(batches), "pieces": pieces, "add": add / len(batches), "flush": flush / len(batches),
            "all": everything / len(batches), "bytes": written}


def time_check(ledger_dir: str) -> dict:
    start = time.perf_counter()
    ledger = read_ledger(ledger_dir)
    read = time.perf_counter() - start
    report = check(ledger)
    return {"read": read, "check": time.perf_counter() - start - read, "ok": report["ok"],
            "pieces": len(ledger.pieces["step"])}


def median(values) -> float:
    return float(statistics.median(values))


def measure(url: str, ledger_dir: str, repeats: int) -> dict:
    cases = [(w, on) for w in WORKERS for on in (False, True)]
    runs: dict = {c: [] for c in cases}
    for round_idx in range(repeats + 1):
        for w, on in cases:
            result = time_pass(url, w, ledger_dir if on else None)
            print(f"round {round_idx} workers={w} ledger={'on' if on else 'off'}: "
                  f"{result['tokens'] / result['seconds'] / M:.1f}M tokens/s, "
                  f"{result['tokens'] / result['cpu'] / M:.1f}M per CPU-second")
            if round_idx:
                runs[w, on].append(result)
    return {(*c, clock): median([r["tokens"] / r[clock] for r in rs]) for c, rs in runs.items()
            for clock in ("seconds", "cpu")}


def section(rate: dict, cost: dict, checked: dict, meta: dict, args, command: str) -> str:
    host = (f"{platform.machine()} with {os.cpu_count()} CPUs (shared; load average "
            f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}), Python {platform.python_version()}, "
            f"torch {torch.__version__}")
    lines = [
        "## Data-order ledger overhead (`tools/bench_ledger.py`)", "",
        f"`{command}`, {datetime.date.today().isoformat()}, {host}.",
        f"Corpus: the pipeline benchmark's, {meta['tokens']:,} tokens, {meta['documents']:,} documents "
        f"(median 600 tokens). One pass of {BATCH}x{SEQ_LEN} batches, `state_dict()` every "
        f"{CHECKPOINT_EVERY} steps in every case; ledger on local disk, default `chunk_steps`; medians of "
        f"{args.repeats} passes per case after an uncounted warm-up round, cases interleaved.", "",
        "| num_workers | per | no ledger | ledger | ledger / none |", "|---|---|---|---|---|",
    ]
    for w in WORKERS:
        for clock, label in (("seconds", "second"), ("cpu", "CPU-second of the training process")):
            off, on = rate[w, False, clock], rate[w, True, clock]
            lines.append(f"| {w} | tokens per {label} | {off / M:.1f}M | {on / M:.1f}M | {on / off:.3f} |")
    per_piece = cost["bytes"] / cost["pieces"]
    lines += [
        "",
        f"The writer alone, over the first {cost['steps']:,} batches of the pass ({cost['pieces'] / cost['steps']:.1f} "
        f"pieces per step), CPU time of the training thread: `add` {cost['add'] * 1e6:.1f} us per step, "
        f"encoding a chunk every {CHECKPOINT_EVERY} steps {cost['flush'] * 1e6:.1f} us per step; with the "
        f"background thread's puts to local disk, {cost['all'] * 1e6:.1f} us per step in all; against "
        f"{BATCH * SEQ_LEN / rate[0, False, 'cpu'] * 1e6:.0f} us of CPU to build a step at num_workers=0 "
        "without it (CPU time, so the figures hold on a loaded machine). "
        f"It wrote {cost['bytes'] / cost['steps']:,.0f} bytes per step ({per_piece:.1f} per piece).",
        "",
        f"`read_ledger` + `check` over one whole pass ({checked['pieces']:,} pieces): "
        f"{checked['read']:.3f} s + {checked['check']:.3f} s ({'clean' if checked['ok'] else 'PROBLEMS'}).",
        "",
        "Tokens per second move by tens of percent from pass to pass on this shared machine; tokens "
        "per CPU-second of the training process (all its threads; at num_workers=2 the workers' own "
        "CPU is not in it, and the ledger's cost is all in the training process) and the writer's "
        "own time are the figures that hold still.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=20e6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join("docs", "benchmarks.md"))
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    args = parser.parse_args(argv)
    command = ("python tools/bench_ledger.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    root = os.path.join(ROOT, "bench-out", "ledger")
    meta = ensure_corpus(os.path.join(root, f"t{int(args.tokens)}"), int(args.tokens))
    ledger_dir = os.path.join(root, "ledger-run")
    rate = measure(meta["url"], ledger_dir, args.repeats)
    checked = time_check(ledger_dir)  # the last pass's ledger (num_workers=2)
    cost = writer_cost(meta["url"], os.path.join(root, "ledger-writer"))
    text = section(rate, cost, checked, meta, args, command)
    print(text)
    if not args.no_write:
        from _benchdoc import publish

        publish("ledger", text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
