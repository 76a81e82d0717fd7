"""Pipeline throughput next to two ceilings, bytes per token across the worker boundary, and
resume latency, for one job: one pass of 8x2048 full-contract batches.

    python tools/bench_pipeline.py [--tokens 50e6] [--repeats 3] [--out docs/benchmarks.md] [--quick]
                                   [--resume-repeats 7] [--no-write] [--profile N]

1. Corpus (built once under ``bench-out/pipeline/``, reused while its parameters match): one
   stream, lognormal document lengths (median 600, sigma 1.0), ids ``zipf(1.3) % 50256``
   (compress about like real tokens), written by ``ShardWriter`` without trailing EOS; and the
   same documents, each followed by EOS, as one flat uint16 file.
2. Per repeat, in turn (so machine noise hits every case alike):
   - zstd ceiling: every frame of every shard decompressed with python-zstandard on one core,
     shard bytes already in memory; corpus tokens / seconds.
   - memmap ceiling: the flat file packed into the same batches (input_ids, labels,
     position_ids int64, doc_ids int32, source_ids int16; labels -100 at document ends,
     positions restarting at each document and row) with vectorized numpy, one process.
   - streamforge: ``PackedTokenDataset(url, seq_len=2048, seed=0)`` and
     ``StreamingLoader(ds, batch_size=8, num_workers=N)`` for N in 0, 2; non-padding tokens
     delivered / seconds from ``iter()`` to the end of the pass; also time to first batch.
3. Bytes per token that cross the process boundary: one worker message (``RowBatch`` and
   the state, stats and skips sent along), pickled as torch's worker queue does.
4. Resume latency at ~10%, 50%, 90% of the pass: new dataset + loader + ``load_state_dict`` +
   first batch, over a fresh start's new dataset + loader + first batch.

Medians over ``--repeats``. Figures go to the ``pipeline`` section of docs/benchmarks.md, with
a chart in docs/img/pipeline_throughput.png.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import shutil
import statistics
import sys
import time
from multiprocessing.reduction import ForkingPickler

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zstandard  # noqa: E402
from tqdm import tqdm  # noqa: E402

from streamforge import PackedTokenDataset, ShardWriter, StreamingLoader, unpack_state  # noqa: E402
from streamforge.pipeline.batch import expand  # noqa: E402
from streamforge.source import ShardSource  # noqa: E402

VOCAB = 50257
EOS = 50256
SEQ_LEN = 2048
BATCH = 8
WORKERS = (0, 2)
POSITIONS = (0.1, 0.5, 0.9)
LITDATA = 51e6  # the figure for LitData from zstd chunks, no workers, this machine
TARGET_W0 = 0.30  # of the zstd ceiling
TARGET_W2 = 25e6
TARGET_RESUME = 1.5
TARGET_EVAL = 0.90  # evaluation pass tokens/s over the training pass, same num_workers
IGNORE = -100
M = 1e6


# -- corpus --------------------------------------------------------------------------------------
def corpus_params(num_tokens: int) -> dict:
    return {"layout": 1, "tokens": num_tokens, "seed": 0, "median": 600, "sigma": 1.0,
            "zipf": 1.3, "vocab": VOCAB, "eos_id": EOS, "shard_size": "64MiB"}


def ensure_corpus(root: str, num_tokens: int) -> dict:
    """The corpus under ``root`` (built unless one with the same parameters is there)."""
    from _benchdoc import cached_meta

    params = corpus_params(num_tokens)
    meta = cached_meta(root, params)
    if meta is not None:
        print(f"corpus: reusing {root}")
        return meta
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    meta = write_corpus(root, params)
    with open(os.path.join(root, "corpus.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def write_corpus(root: str, params: dict) -> dict:
    rng = np.random.default_rng(params["seed"])
    url, flat = os.path.join(root, "stream"), os.path.join(root, "flat.u16")
    docs = written = 0
    eos = np.array([EOS], np.uint16)
    bar = tqdm(total=params["tokens"], unit="tok", unit_scale=True, desc="corpus", leave=False)
    with ShardWriter(url, shard_size=params["shard_size"], eos_id=EOS, vocab_size=VOCAB) as writer, \
            open(flat, "wb") as out:
        while written < params["tokens"]:
            lengths = rng.lognormal(np.log(params["median"]), params["sigma"], 2048).astype(np.int64)
            lengths = np.maximum(lengths, 1)
            ids = (rng.zipf(params["zipf"], int(lengths.sum())) % EOS).astype(np.uint16)
            pieces = []
            for doc in np.split(ids, np.cumsum(lengths)[:-1]):
                if written >= params["tokens"]:
                    break
                writer.write(doc)
                pieces += [doc, eos]
                docs, written = docs + 1, written + len(doc)
                bar.update(len(doc))
            out.write(np.concatenate(pieces).tobytes())
    bar.close()
    manifest = writer.close()
    return {"params": params, "url": url, "flat": flat, "documents": docs, "tokens": written,
            "shards": manifest.num_shards, "shard_bytes": int(manifest.num_bytes)}


# -- ceilings ------------------------------------------------------------------------------------
def load_frames(url: str) -> tuple[list[tuple[bytes, np.ndarray]], int]:
    """Each shard's bytes with its frame table, read before any timing; and the raw bytes."""
    source = ShardSource.open(url)
    shards, raw = [], 0
    for shard, name in enumerate(source.manifest.shard_names):
        frames = source.index(shard).frames
        with open(os.path.join(url, name), "rb") as f:
            shards.append((f.read(), frames))
        raw += int(frames["raw_size"].sum())
    return shards, raw


def time_zstd(shards: list[tuple[bytes, np.ndarray]]) -> float:
    decompressor = zstandard.ZstdDecompressor()
    start = time.perf_counter()
    for blob, frames in shards:
        view = memoryview(blob)
        for off, size, raw in zip(frames["comp_offset"].tolist(), frames["comp_size"].tolist(),
                                  frames["raw_size"].tolist()):
            decompressor.decompress(view[off : off + size], max_output_size=raw)
    return time.perf_counter() - start


def pack_flat(tokens: np.ndarray, eos_id: int) -> dict[str, torch.Tensor]:
    """Rows of ``tokens`` (plus one lookahead token; a short tail is padded) as the batch
    contract: the same five tensors ``StreamingLoader`` hands out."""
    real = len(tokens) - 1  # tokens that get an input position
    rows = -(-real // SEQ_LEN)
    size = rows * SEQ_LEN
    if real < size:
        tokens = np.concatenate([tokens, np.zeros(size - real, tokens.dtype)])
    input_ids = np.empty((rows, SEQ_LEN), np.int64)
    input_ids[...] = tokens[:size].reshape(rows, SEQ_LEN)
    labels = np.empty((rows, SEQ_LEN), np.int64)
    labels[...] = tokens[1 : size + 1].reshape(rows, SEQ_LEN)
    ends = np.flatnonzero(tokens[:real] == eos_id)
    labels.reshape(-1)[ends] = IGNORE
    # documents (cut at row boundaries) as (start, length) pieces
    starts = np.union1d(np.arange(0, size, SEQ_LEN), ends[ends + 1 < size] + 1)
    lengths = np.diff(np.append(starts, size))
    positions = np.arange(size) - np.repeat(starts, lengths)
    row = starts // SEQ_LEN
    doc_ids = np.repeat((np.arange(len(starts)) - np.searchsorted(row, row)).astype(np.int32), lengths)
    source_ids = np.zeros(size, np.int16)
    if real < size:  # the tail of the pass: padding after the last token
        labels.reshape(-1)[real:] = IGNORE
        positions[real:] = 0
        doc_ids[real:] = -1
        source_ids[real:] = -1
    out = {"input_ids": input_ids, "labels": labels, "position_ids": positions,
           "doc_ids": doc_ids, "source_ids": source_ids}
    return {k: torch.from_numpy(v.reshape(rows, SEQ_LEN)) for k, v in out.items()}


def time_memmap(path: str) -> tuple[float, int]:
    """One pass over the flat file in 8x2048 batches; (seconds, tokens)."""
    start = time.perf_counter()
    flat = np.memmap(path, np.uint16, mode="r")
    step = BATCH * SEQ_LEN
    tokens = 0
    for lo in range(0, len(flat), step):
        batch = pack_flat(flat[lo : lo + step + 1], EOS)
        tokens += min(step, len(flat) - lo)
        del batch
    return time.perf_counter() - start, tokens


# -- streamforge ---------------------------------------------------------------------------------
def make_loader(url: str, num_workers: int, evaluation: bool = False) -> StreamingLoader:
    dataset = PackedTokenDataset(url, seq_len=SEQ_LEN, seed=0, evaluation=evaluation)
    return StreamingLoader(dataset, batch_size=BATCH, num_workers=num_workers)


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens; in concat packing only a worker's last batch ends in padding."""
    doc_ids = batch["doc_ids"]
    last = doc_ids.numpy()[-1, -1] if doc_ids.device.type == "cpu" else doc_ids[-1, -1]
    if last >= 0:  # cheap: a torch scalar index costs ~5 us, a numpy one ~1 us
        return batch["input_ids"].numel()
    return int((batch["doc_ids"] >= 0).sum())


def time_pass(url: str, num_workers: int, evaluation: bool = False) -> dict:
    loader = make_loader(url, num_workers, evaluation)
    tokens = batches = 0
    first = None
    start = time.perf_counter()
    for batch in loader:
        if first is None:
            first = time.perf_counter() - start
        tokens += real_tokens(batch)
        batches += 1
    wall = time.perf_counter() - start
    return {"seconds": wall, "tokens": tokens, "batches": batches, "first": first}


def state_at(url: str, num_workers: int, batches: int) -> dict:
    loader = make_loader(url, num_workers)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    state = loader.state_dict()
    it.close()
    return state


def time_first_batch(url: str, num_workers: int, state: dict | None = None) -> float:
    """New dataset + loader (+ load_state_dict) + first batch, in seconds."""
    start = time.perf_counter()
    loader = make_loader(url, num_workers)
    if state is not None:
        loader.load_state_dict(state)
    it = iter(loader)
    next(it)
    elapsed = time.perf_counter() - start
    it.close()
    return elapsed


def boundary_bytes(url: str) -> dict:
    """Pickled size of one worker message (as torch's worker queue sends it) per token."""
    dataset = PackedTokenDataset(url, seq_len=SEQ_LEN, seed=0)
    pipeline = dataset.make_pipeline(0, 2)
    try:
        for _ in range(10):  # a batch from the middle of a window
            rows = pipeline.next_batch(BATCH)
        message = ("batch", 0, rows, pipeline.state_dict(), pipeline.stats(), pipeline.skipped())
        expanded = expand(rows)
    finally:
        pipeline.close()
    tokens = rows.num_tokens
    return {
        "tokens": tokens,
        "rows": len(ForkingPickler.dumps(rows)) / tokens,
        "message": len(ForkingPickler.dumps(message)) / tokens,
        "expanded": sum(t.numel() * t.element_size() for t in expanded.values()) / tokens,
    }


def profile_pass(url: str, top: int) -> None:
    """cProfile of one num_workers=0 pass: the top costs by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    time_pass(url, 0)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


# -- the run -------------------------------------------------------------------------------------
def measure_throughput(meta: dict, repeats: int) -> dict[str, list[dict]]:
    """Each case once per repeat, interleaved: {case: [{"seconds", "tokens", ...}, ...]}."""
    shards, _ = load_frames(meta["url"])
    cases = ["zstd", "memmap"] + [f"w{w}" for w in WORKERS] + [f"e{w}" for w in WORKERS]
    out: dict[str, list[dict]] = {c: [] for c in cases}
    # round 0 warms the page cache and the allocator and is not counted
    with tqdm(total=(repeats + 1) * len(cases), desc="throughput", leave=False) as bar:
        for round_idx in range(repeats + 1):
            for case in cases:
                bar.set_postfix_str(case)
                result = run_case(case, meta, shards)
                if round_idx:
                    out[case].append(result)
                bar.update()
    return out


def run_case(case: str, meta: dict, shards) -> dict:
    if case == "zstd":
        return {"seconds": time_zstd(shards), "tokens": meta["tokens"]}
    if case == "memmap":
        seconds, tokens = time_memmap(meta["flat"])
        return {"seconds": seconds, "tokens": tokens}
    return time_pass(meta["url"], int(case[1:]), evaluation=case[0] == "e")


def check_contract(url: str, num_batches: int = 50) -> int:
    """The memmap ceiling builds the loader's very batches: ``pack_flat`` over the tokens of a
    pipeline's rows (laid end to end, plus the lookahead) must equal ``expand`` of those rows."""
    pipeline = PackedTokenDataset(url, seq_len=SEQ_LEN, seed=0).make_pipeline(0, 1)
    try:
        for i in range(num_batches):
            rows = pipeline.next_batch(BATCH)
            if rows is None or not rows.lookahead[-1]:
                return i  # end of pass: the padded tail is checked by the memmap pass itself
            flat = np.concatenate([rows.tokens[:, :SEQ_LEN].reshape(-1), rows.tokens[-1:, SEQ_LEN]])
            got, want = pack_flat(flat, EOS), expand(rows)
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            if bad:
                raise RuntimeError(f"memmap ceiling differs from the loader's batch {i} in {bad}")
    finally:
        pipeline.close()
    return num_batches


def measure_resume(url: str, pass_batches: dict[int, int], repeats: int) -> dict:
    """{(workers, position or None): [seconds, ...]}; None is a fresh start."""
    states = {}
    for w in WORKERS:
        for frac in tqdm(POSITIONS, desc=f"states w{w}", leave=False):
            states[w, frac] = state_at(url, w, max(1, round(frac * pass_batches[w])))
    keys = [(w, None) for w in WORKERS] + list(states)
    out: dict = {k: [] for k in keys}
    with tqdm(total=repeats * len(keys), desc="resume", leave=False) as bar:
        for _ in range(repeats):
            for key in keys:
                out[key].append(time_first_batch(url, key[0], states.get(key)))
                bar.update()
    return {"times": out, "batches": {k: unpack_state(v)["batch"] for k, v in states.items()}}


def median(values) -> float:
    return float(statistics.median(values))


def summarize(runs: dict[str, list[dict]], resume: dict, wire: dict) -> dict:
    rate = {c: median([r["tokens"] / r["seconds"] for r in rs]) for c, rs in runs.items()}
    first = {c: median([r["first"] for r in rs]) for c, rs in runs.items() if "first" in rs[0]}
    times = {k: median(v) for k, v in resume["times"].items()}
    ratios = {k: t / times[k[0], None] for k, t in times.items() if k[1] is not None}
    checks = [
        ("num_workers=0 / zstd ceiling", rate["w0"] / rate["zstd"], f">= {TARGET_W0:.0%}",
         rate["w0"] >= TARGET_W0 * rate["zstd"], f"{rate['w0'] / rate['zstd']:.1%}"),
        ("num_workers=2 tokens/s", rate["w2"], f">= {TARGET_W2 / M:.0f}M",
         rate["w2"] >= TARGET_W2, f"{rate['w2'] / M:.1f}M"),
        ("resume / fresh start, worst", max(ratios.values()), f"<= {TARGET_RESUME}x",
         max(ratios.values()) <= TARGET_RESUME, f"{max(ratios.values()):.2f}x"),
        *[(f"evaluation / training tokens/s, num_workers={w}", rate[f"e{w}"] / rate[f"w{w}"],
           f">= {TARGET_EVAL:.0%}", rate[f"e{w}"] >= TARGET_EVAL * rate[f"w{w}"],
           f"{rate[f'e{w}'] / rate[f'w{w}']:.1%}") for w in WORKERS],
    ]
    return {"rate": rate, "first": first, "resume": times, "ratios": ratios, "checks": checks,
            "wire": wire, "state_batches": resume["batches"]}


CASE_NAMES = {
    "zstd": "ceiling: raw zstd decompression of the shards, 1 core",
    "memmap": "ceiling: packing the flat np.memmap, 1 process",
    "w0": "streamforge, num_workers=0",
    "w2": "streamforge, num_workers=2",
    "e0": "streamforge evaluation pass (`evaluation=True`), num_workers=0",
    "e2": "streamforge evaluation pass (`evaluation=True`), num_workers=2",
}


def throughput_table(s: dict) -> list[str]:
    lines = ["| case | tokens/s (median) | of zstd ceiling | first batch (s) |", "|---|---|---|---|"]
    for case, name in CASE_NAMES.items():
        first = f"{s['first'][case]:.3f}" if case in s["first"] else "-"
        lines.append(f"| {name} | {s['rate'][case] / M:.1f}M | {s['rate'][case] / s['rate']['zstd']:.1%} | {first} |")
    lines.append(f"| for scale: LitData from zstd chunks, no workers (the issue's figure, not measured here) "
                 f"| {LITDATA / M:.0f}M | {LITDATA / s['rate']['zstd']:.1%} | - |")
    return lines


def resume_table(s: dict, pass_batches: dict[int, int]) -> list[str]:
    head = " | ".join(f"at {f:.0%}" for f in POSITIONS)
    lines = [f"| num_workers | fresh start (s) | {head} |", "|---" * (2 + len(POSITIONS)) + "|"]
    for w in WORKERS:
        cells = [f"{s['resume'][w, f]:.3f} s ({s['ratios'][w, f]:.2f}x, batch "
                 f"{s['state_batches'][w, f]}/{pass_batches[w]})" for f in POSITIONS]
        lines.append(f"| {w} | {s['resume'][w, None]:.3f} | " + " | ".join(cells) + " |")
    return lines


def checks_table(s: dict) -> list[str]:
    lines = ["| target | measured | wanted | |", "|---|---|---|---|"]
    for name, _, wanted, ok, shown in s["checks"]:
        lines.append(f"| {name} | {shown} | {wanted} | {'PASS' if ok else 'FAIL'} |")
    return lines


def plot(s: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["zstd\nceiling", "memmap\nceiling", "streamforge\nworkers=0", "streamforge\nworkers=2",
              "eval\nworkers=0", "eval\nworkers=2"]
    values = [s["rate"][c] / M for c in ("zstd", "memmap", "w0", "w2", "e0", "e2")]
    fig, ax = plt.subplots(figsize=(8.5, 4))
    bars = ax.bar(labels, values, color=["#9e9e9e", "#9e9e9e", "#1f77b4", "#1f77b4", "#2ca02c", "#2ca02c"])
    ax.bar_label(bars, fmt="%.0fM")
    ax.hlines(TARGET_W0 * s["rate"]["zstd"] / M, 1.6, 2.4, colors="C3", linestyles="--",
              label=f"target workers=0: {TARGET_W0:.0%} of zstd")
    ax.hlines(TARGET_W2 / M, 2.6, 3.4, colors="C1", linestyles="--", label="target workers=2: 25M")
    ax.axhline(LITDATA / M, color="C2", linestyle=":", label="LitData, no workers (issue's figure)")
    ax.set_ylabel("tokens/s (millions), median")
    ax.set_title(f"One pass, {BATCH}x{SEQ_LEN} full-contract batches")
    ax.legend(fontsize=8)
    from _benchdoc import save_figure

    save_figure(fig, path)


def machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.machine()} with {os.cpu_count()} CPUs (shared; load average {load} at the start), "
            f"Python {platform.python_version()}, torch {torch.__version__}, zstandard {zstandard.__version__}")


def section(s: dict, meta: dict, args, command: str, host: str, pass_batches: dict) -> str:
    wire = s["wire"]
    lines = [
        "## Pipeline throughput, ceilings and resume (`tools/bench_pipeline.py`)", "",
        f"`{command}`, {datetime.date.today().isoformat()}, {host}.",
        f"Corpus: one stream, {meta['documents']:,} documents, {meta['tokens']:,} tokens in "
        f"{meta['shards']} shard(s) of up to 64 MiB ({meta['shard_bytes'] / M:.1f} MB, "
        f"{meta['tokens'] * 2 / meta['shard_bytes']:.2f}x smaller than the uint16 tokens); lognormal "
        "lengths (median 600, sigma 1.0), ids `zipf(1.3) % 50256`, EOS 50256 appended by the pipeline. "
        f"Job: one pass of {BATCH}x{SEQ_LEN} batches, `PackedTokenDataset(url, seq_len={SEQ_LEN}, seed=0)` "
        f"(concat packing, shuffle_buffer 8192), `StreamingLoader(batch_size={BATCH})`; medians of "
        f"{args.repeats} passes per case (after one uncounted warm-up round) and {args.resume_repeats} "
        "starts per resume case, cases interleaved.", "",
        "![pipeline throughput](img/pipeline_throughput.png)", "",
        *throughput_table(s), "",
        "tokens/s counts non-padding tokens delivered (documents plus their EOS) over the seconds from "
        "`iter()` to the end of the pass; the zstd ceiling divides the corpus tokens by the time to "
        "decompress every frame of every shard already in memory, and the memmap ceiling packs the "
        "flat file (same documents, same EOS) into the same five tensors in file order, without "
        "shuffling.", "",
        "Bytes per token crossing the process boundary (num_workers > 0), pickled as torch's "
        "worker queue does:", "",
        "| what | bytes/token |", "|---|---|",
        f"| `RowBatch` alone | {wire['rows']:.2f} |",
        f"| whole worker message (`RowBatch`, state, stats, skips) | {wire['message']:.2f} |",
        f"| for comparison: the expanded batch (5 tensors) | {wire['expanded']:.2f} |", "",
        "Resume latency (new dataset + loader + `load_state_dict` + first batch) against a fresh "
        "start (new dataset + loader + first batch), medians:", "",
        *resume_table(s, pass_batches), "",
        *checks_table(s),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=50e6, help="corpus size (default 50e6)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; medians reported")
    parser.add_argument("--resume-repeats", type=int, default=7,
                        help="starts per resume case (cheap, and noisier than whole passes)")
    parser.add_argument("--out", default=os.path.join("docs", "benchmarks.md"),
                        help="benchmarks document whose 'pipeline' section is rewritten")
    parser.add_argument("--quick", action="store_true",
                        help="5M tokens, 1 repeat, print only (a smoke run)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    parser.add_argument("--profile", type=int, metavar="N", default=0,
                        help="also print the top N functions of a cProfile'd num_workers=0 pass")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats, args.resume_repeats = min(args.tokens, 5e6), 1, 1
        args.no_write = True
    args.tokens = int(args.tokens)
    if args.tokens < BATCH * SEQ_LEN * 20 or min(args.repeats, args.resume_repeats) < 1:
        parser.error(f"--tokens must be >= {BATCH * SEQ_LEN * 20}, --repeats and --resume-repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python tools/bench_pipeline.py " + " ".join(sys.argv[1:] if argv is None else argv)
    host = machine()
    meta = ensure_corpus(os.path.join(ROOT, "bench-out", "pipeline", f"t{args.tokens}"), args.tokens)
    print(f"corpus: {meta['documents']:,} documents, {meta['tokens']:,} tokens, {meta['shards']} shards")
    print(f"contract: memmap packing equals the loader's first {check_contract(meta['url'])} batches")
    runs = measure_throughput(meta, args.repeats)
    pass_batches = {w: runs[f"w{w}"][0]["batches"] for w in WORKERS}
    resume = measure_resume(meta["url"], pass_batches, args.resume_repeats)
    summary = summarize(runs, resume, boundary_bytes(meta["url"]))
    text = section(summary, meta, args, command.strip(), host, pass_batches)
    print(text)
    if args.profile:
        profile_pass(meta["url"], args.profile)
    if not args.no_write:
        from _benchdoc import publish

        publish("pipeline", text, args.out, lambda path: plot(summary, path), "pipeline_throughput.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
