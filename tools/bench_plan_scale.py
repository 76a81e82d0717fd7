"""The shard plan, the global state and the elastic re-plan at paper scale, without training.

    python tools/bench_plan_scale.py [--topologies 1x1,8x8,64x8,256x8,512x8,1024x8,4096x8]
                                     [--shards 6000,3000,1000] [--records 2000,1500,100]
                                     [--shard-sweep 0.5,1,2,4] [--sweep-topology 1024x8]
                                     [--pass-tokens 10e12] [--rank-tokens-s 1e6]
                                     [--elastic 1024x8:768x8] [--window 512] [--repeats 3]
                                     [--agree-ranks 4] [--out docs/benchmarks.md] [--no-write]

What is simulated (nothing is read from storage, no shard file exists):

* Corpus: three streams, ``web`` / ``code`` / ``books``, 10,000 shards in all (6000 / 3000 /
  1000 by default). Records per shard are Poisson around 2000 / 1500 / 100; record lengths are
  lognormal (median 600 / 1200 / 50,000 tokens, sigma 1.0 / 1.2 / 0.7), with 0.5% empty
  records. Shards are smaller than production ones (2-6M tokens rather than tens of millions)
  so that every record's length fits in memory on a small machine; the plan's cost grows with
  shards and workers, not with records per shard.
* Manifests: real ``Manifest`` objects built in memory, whose per-shard ``num_records``,
  ``num_tokens`` and ``num_docs`` are the sums of the generated record lengths.
* Record indexes: the planner's ``sources`` callable returns a stand-in source whose
  ``index(shard).records["num_tokens"]`` are the generated lengths (what a ranged read of
  the shard's index returns), so the planner runs its own code, index reads included: only
  their I/O is missing. The tables count them (one ranged GET each in production).
* Global state: one genuine pipeline state, taken from a real ``StreamingLoader`` over a tiny
  three-stream corpus written with ``ShardWriter`` in a temporary directory, replicated for
  every (rank, worker) with its integers redrawn at a long run's magnitudes (two more digits).
* Elastic re-plan: the work a job on the old topology leaves when saved about halfway through
  pass 0, in the form ``elastic.work_left`` returns: per old worker and stream, the unread tail
  of its ranges plus the not yet emitted documents of its current shuffle window (``--window``
  records per window; the carry's token offset on the first one). ``remaining_plan`` is timed
  over the new topology with a fresh planner (its index reads included).

Reported per topology: plan time (``Planner.pass_plan`` of pass 0 for the three streams with
exact counts, fresh planner, median of ``--repeats``; wall and CPU seconds), token imbalance
max/mean over global workers per stream and overall (tokens with EOS), the share of each
stream's tokens the pass drops (``PassPlan.dropped_tokens()``'s arithmetic, worker by worker),
whether the 1.01 target holds where a stream has at least 4x more records than workers, steps
per pass recomputed in separate processes for a sample of ranks, and the packed global state
size; then the same plan with token cuts (``cuts="tokens"``, ``scale_cuts.py``): its time, the
imbalance and dropped share per stream, the tokens dropped and the drop bound. Then: plan time against shards (``--shard-sweep``: the same records over more shards, at
``--sweep-topology``); the record-index GETs a rank makes to plan, alone and shared, and the
job's requests before its first batch; requests per GB of a pass and GET/s per stream prefix
at ``--rank-tokens-s`` per read-ahead setting (``scale_requests.py``). Figures go to the ``plan-scale`` section of
docs/benchmarks.md, with a chart in docs/img/plan_scale.png.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from streamforge.resume import elastic  # noqa: E402
from streamforge.format.manifest import Manifest, shard_name  # noqa: E402
from streamforge.planning.plan import trim_ranges  # noqa: E402
from streamforge.planning.planner import Planner  # noqa: E402
from streamforge.stages.window_order import nonempty_order  # noqa: E402
from streamforge.resume.state import pack_state  # noqa: E402
from scale_cuts import cut_figures, cut_lines, set_cuts  # noqa: E402
from scale_requests import (dropped_shares, notes, pass_requests, plot, requests_lines,  # noqa: E402
                            shard_sweep, startup_lines, startup_reads, sweep_lines)

NAMES = ("web", "code", "books")
MEDIANS = (600, 1200, 50_000)
SIGMAS = (1.0, 1.2, 0.7)
EMPTY = 0.005
SEED = 0
SEQ_LEN = 2048
BATCH = 8
TARGET_IMBALANCE = 1.01
TARGET_REPLAN = 1.0  # seconds
RECORDS_PER_WORKER = 4  # the imbalance target applies where records >= 4x workers


# -- synthetic corpus ----------------------------------------------------------------------------
class SyntheticStream:
    """Per-record token lengths of one stream, its manifest, and index reads of them."""

    def __init__(self, stream: int, shards: int, records: int, seed: int = SEED) -> None:
        rng = np.random.default_rng([seed, stream])
        n = np.maximum(rng.poisson(records, shards), 1).astype(np.int64)
        lengths = rng.lognormal(np.log(MEDIANS[stream]), SIGMAS[stream], int(n.sum()))
        lengths = np.clip(lengths, 1, 2**31 - 1).astype(np.int64)
        lengths[rng.random(len(lengths)) < EMPTY] = 0
        self.offsets = np.concatenate([[0], np.cumsum(n)])
        self.lengths = lengths.astype(np.int32)
        starts = self.offsets[:-1]
        tokens = np.add.reduceat(lengths, starts)
        docs = np.add.reduceat((lengths > 0).astype(np.int64), starts)
        self.manifest = Manifest(
            token_dtype="uint16",
            shard_names=[shard_name(i) for i in range(shards)],
            shard_sha256=["0" * 64] * shards,
            columns={
                "bytes": tokens * 2, "num_records": n, "num_tokens": tokens,
                "num_frames": -(-tokens // 65536), "index_offset": tokens * 2,
                "index_bytes": n * 16, "num_docs": docs,
            },
            eos_id=0,
        )
        self.config = SimpleNamespace(on_error="raise")
        self.on_error = "raise"  # as a shard source says it (window_order)
        self.reads = 0

    def index(self, shard: int):
        self.reads += 1
        return SimpleNamespace(records={"num_tokens": self.lengths[self.offsets[shard]:self.offsets[shard + 1]]})


class Corpus:
    def __init__(self, shards, records, seed: int = SEED) -> None:
        self.streams = [SyntheticStream(i, s, r, seed) for i, (s, r) in enumerate(zip(shards, records))]
        self.manifests = [s.manifest for s in self.streams]

    def source(self, stream: int) -> SyntheticStream:
        return self.streams[stream]

    def planner(self) -> Planner:
        return Planner(NAMES[: len(self.streams)], self.manifests, seed=SEED, sources=self.source)

    def reads(self) -> int:
        return sum(s.reads for s in self.streams)

    def reset_reads(self) -> None:
        for s in self.streams:
            s.reads = 0


def plan_kwargs(world: int, workers: int, n_streams: int) -> dict:
    return dict(world_size=world, workers_per_rank=workers, batch_size=BATCH, seq_len=SEQ_LEN,
                packing="concat", eos_appended=[True] * n_streams)


# -- plan time, imbalance ----------------------------------------------------------------------
def time_plan(corpus: Corpus, world: int, workers: int, repeats: int, cuts: bool = False):
    """(seconds per repeat, CPU seconds per repeat, index reads of one plan, the last plan and
    its planner); ``cuts``: with token cuts."""
    seconds, cpu, plan, planner = [], [], None, None
    for _ in range(repeats):
        corpus.reset_reads()
        planner = corpus.planner()
        if cuts:
            set_cuts(planner, world, workers, BATCH, SEQ_LEN, len(corpus.streams))
        start, start_cpu = time.perf_counter(), time.process_time()
        plan = planner.pass_plan(0, **plan_kwargs(world, workers, len(corpus.streams)))
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return seconds, cpu, corpus.reads(), plan, planner


def imbalance(plan, planner) -> tuple[list[float], float, list[float]]:
    """max/mean tokens over global workers: per stream (raw tokens), and overall (with EOS);
    and the share of each stream's tokens the pass drops (``dropped_shares``)."""
    per_stream, tokens = [], []
    for s, per_worker in enumerate(plan.ranges):
        tokens.append(np.array([planner.totals(s, ranges)[0] for ranges in per_worker], np.float64))
        per_stream.append(float(tokens[-1].max() / tokens[-1].mean()))
    overall = np.array(plan.tokens, np.float64)
    return per_stream, float(overall.max() / overall.mean()), dropped_shares(plan, tokens)


# -- steps per pass, computed apart -------------------------------------------------------------
_CORPUS: Corpus | None = None  # the forked workers' copy


def _rank_plan(args) -> tuple[int, int, str, list[int]]:
    """What rank ``rank`` computes on its own: a fresh planner's plan of pass 0."""
    rank, world, workers = args
    plan = _CORPUS.planner().pass_plan(0, **plan_kwargs(world, workers, len(_CORPUS.streams)))
    digest = hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
    return rank, plan.steps, digest, [plan.batches_of(w) for w in range(workers)]


def agreement(corpus: Corpus, world: int, workers: int, sample: int) -> dict:
    """Plans of a sample of ranks, each computed in its own process from the same inputs."""
    global _CORPUS
    _CORPUS = corpus
    ranks = sorted({round(i * (world - 1) / max(sample - 1, 1)) for i in range(sample)})
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(min(2, len(ranks))) as pool:
        results = pool.map(_rank_plan, [(r, world, workers) for r in ranks])
    steps = {s for _, s, _, _ in results}
    digests = {d for _, _, d, _ in results}
    return {"ranks": ranks, "steps": sorted(steps), "agree": len(steps) == 1 and len(digests) == 1}


# -- global state ----------------------------------------------------------------------------------
def genuine_state() -> dict:
    """The global state of a real 3-stream loader after a few batches (tiny corpus in a temp dir)."""
    from streamforge import PackedTokenDataset, ShardWriter, Stream, StreamingLoader
    from streamforge.resume.state import unpack_state

    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        streams = []
        for name, median in zip(NAMES, (60, 200, 700)):
            url = os.path.join(tmp, name)
            with ShardWriter(url, shard_size="8KiB", frame_size="2KiB", eos_id=0) as writer:
                for k in np.maximum(1, rng.lognormal(np.log(median), 1.0, 200)).astype(int):
                    writer.write(rng.integers(1, 1000, size=int(k)).astype(np.uint16))
            streams.append(Stream(url, weight=1.0, name=name))
        loader = StreamingLoader(PackedTokenDataset(streams, seq_len=64, shuffle_buffer=32), batch_size=2)
        it = iter(loader)
        for _ in range(5):
            next(it)
        state = unpack_state(loader.state_dict())
        it.close()
    return state


def _redraw(value, rng):
    """``value`` with every int redrawn at two more digits (a long run's magnitudes)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(rng.integers(0, 10 ** (len(str(abs(value))) + 2))) if value else 0
    if isinstance(value, dict):
        return {k: _redraw(v, rng) for k, v in value.items()}
    if isinstance(value, list):
        return [_redraw(v, rng) for v in value]
    return value


def state_size(template: dict, world: int, workers: int, work: dict | None = None) -> int:
    """Bytes of the packed global state's JSON for R x W workers (``remaining`` holds ``work``)."""
    rng = np.random.default_rng(2)
    worker = template["ranks"][0]["workers"][0]
    part = template["ranks"][0]
    state = dict(template, world_size=world, workers_per_rank=workers, remaining=None if work is None else {"work": work})
    state["ranks"] = [
        {"rank": r, "workers": [_redraw(worker, rng) for _ in range(workers)],
         "pass_tokens": int(rng.integers(0, 10**12)), "counters": _redraw(part["counters"], rng),
         "skipped": []}
        for r in range(world)
    ]
    return len(pack_state(state)["state"].encode())


# -- elastic ----------------------------------------------------------------------------------------
def saved_work(corpus: Corpus, world: int, workers: int, window: int, seed: int = 3):
    """The work a job on ``world`` x ``workers`` leaves about halfway through pass 0, in
    ``elastic.work_left``'s form (see the module docstring); and, per stream, the ranges of the
    saved workers' current windows (what ``work_left`` reads from the indexes)."""
    rng = np.random.default_rng(seed)
    n = world * workers
    planner = corpus.planner()
    streams, windows = [], []
    for s in range(len(corpus.streams)):
        lengths = corpus.streams[s].lengths
        offsets = corpus.streams[s].offsets
        ranges_left, units, stream_windows = [], [], []
        for ranges in tqdm(planner.ranges(s, 0, n), desc=f"saved work {NAMES[s]}", leave=False):
            total = sum(b - a for _, a, b in ranges)
            cursor = int(round(rng.uniform(0.45, 0.55) * total))
            end = min(total, (cursor // window + 1) * window) if window else cursor
            ranges_left += [list(r) for r in trim_ranges(ranges, end)]
            if end > cursor:  # the current window: its records read, some not yet emitted
                lo = end - min(window, end)
                in_window = _head(trim_ranges(ranges, lo), end - lo)
                stream_windows.append(in_window)
                shard = np.concatenate([np.full(b - a, k) for k, a, b in in_window])
                record = np.concatenate([np.arange(a, b) for _, a, b in in_window])
                key = int(rng.integers(2**62))
                order = nonempty_order(lengths[offsets[shard] + record], key)  # the window's emission order
                pending = order[len(order) - min(len(order), end - cursor):]
                if len(pending):  # the window's rest, as ShuffleBuffer.work_left describes it
                    eff = lengths[offsets[shard[pending]] + record[pending]] + 1  # EOS appended
                    offset = int(rng.integers(0, int(eff[0])))
                    units.append({"ranges": [list(map(int, r)) for r in in_window], "key": key,
                                  "pos": len(order) - len(pending), "offset": offset,
                                  "tokens": int(eff.sum()) - offset, "docs": len(pending)})
        streams.append({"ranges": elastic._merge(sorted(ranges_left)),
                        "windows": sorted(units, key=lambda u: (u["ranges"], u["key"]))})
        windows.append(stream_windows)
    return {"pass": 0, "deal": elastic.DEAL, "streams": streams}, windows


def _head(ranges, records: int):
    """The first ``records`` records of ``ranges``."""
    out = []
    for shard, a, b in ranges:
        take = min(records, b - a)
        if take > 0:
            out.append((shard, a, a + take))
        records -= take
    return out


def time_replan(corpus: Corpus, work: dict, world: int, workers: int, repeats: int) -> tuple[list[float], object]:
    seconds, plan = [], None
    for _ in range(repeats):
        dataset = SimpleNamespace(
            planner=corpus.planner(), eos_appended=[True] * len(corpus.streams), stream_names=list(NAMES),
            config=SimpleNamespace(seq_len=SEQ_LEN, packing="concat"),
            _index_source=corpus.source,  # the indexes of a window's rest the re-plan splits
        )
        start = time.perf_counter()
        plan = elastic.remaining_plan(dataset, work, world_size=world, workers_per_rank=workers,
                                      batch_size=BATCH, first_step=0)
        seconds.append(time.perf_counter() - start)
    return seconds, plan


def time_window_reads(corpus: Corpus, windows) -> float:
    """Seconds ``work_left`` spends on the saved workers' windows besides cursors: each
    window's records and lengths from the shard indexes, and the window's shuffle order
    (the functions ``ShuffleBuffer.work_left`` calls; index reads are in memory here)."""
    from streamforge.stages.shuffle import _nonempty_order, _window_records

    start = time.perf_counter()
    for s, stream_windows in enumerate(windows):
        for i, ranges in enumerate(stream_windows):
            _, _, lengths = _window_records(corpus.streams[s], ranges)
            _nonempty_order(lengths, i)
    return time.perf_counter() - start


# -- report -----------------------------------------------------------------------------------------
def median(values) -> float:
    return float(statistics.median(values))


def parse_topology(text: str) -> tuple[int, int]:
    r, w = text.lower().split("x")
    return int(r), int(w)


def run(args) -> dict:
    shards = [int(x) for x in args.shards.split(",")]
    records = [int(x) for x in args.records.split(",")]
    topologies = [parse_topology(t) for t in args.topologies.split(",")]
    start = time.perf_counter()
    corpus = Corpus(shards, records)
    built = time.perf_counter() - start
    template = genuine_state()
    rows = []
    for world, workers in tqdm(topologies, desc="topologies"):
        seconds, cpu, reads, plan, planner = time_plan(corpus, world, workers, args.repeats)
        per_stream, overall, dropped = imbalance(plan, planner)
        n = world * workers
        applies = [int(m.num_records) >= RECORDS_PER_WORKER * n for m in corpus.manifests]
        agree = agreement(corpus, world, workers, args.agree_ranks)
        cut_s, cut_cpu, _, cut_plan, _ = time_plan(corpus, world, workers, args.repeats, cuts=True)
        cuts = dict(cut_figures(cut_plan), plan_s=median(cut_s), plan_cpu=median(cut_cpu))
        rows.append({"cuts": cuts,
            "topology": f"{world}x{workers}", "workers": n, "plan_s": median(seconds), "plan_cpu": median(cpu),
            "reads": reads, "dropped": dropped, "startup": startup_reads(corpus.manifests, NAMES, world, workers),
            "imbalance": per_stream, "overall": overall, "applies": applies,
            "target_ok": all(v < TARGET_IMBALANCE for v, a in zip(per_stream, applies) if a),
            "steps": plan.steps, "agree": agree, "state_bytes": state_size(template, world, workers),
        })
    old, new = (parse_topology(t) for t in args.elastic.split(":"))
    work, windows = saved_work(corpus, *old, window=args.window)
    replan_s, replan = time_replan(corpus, work, *new, args.repeats)
    tokens = np.array(replan.tokens, np.float64)
    el = {
        "old": f"{old[0]}x{old[1]}", "new": f"{new[0]}x{new[1]}", "window": args.window,
        "ranges": sum(len(s["ranges"]) for s in work["streams"]),
        "windows": sum(len(s["windows"]) for s in work["streams"]),
        "window_docs": sum(u["docs"] for s in work["streams"] for u in s["windows"]),
        "replan_s": median(replan_s), "steps": replan.steps, "imbalance": float(tokens.max() / tokens.mean()),
        "window_reads_s": time_window_reads(corpus, windows),
        "state_bytes": state_size(template, *new, work=work),
    }
    top_world, top_workers = parse_topology(args.requests_topology)
    planner_top = corpus.planner()
    plan_top = planner_top.pass_plan(0, **plan_kwargs(top_world, top_workers, len(corpus.streams)))
    tokens = [float(m.columns["num_tokens"].sum()) for m in corpus.manifests]
    multipliers = [float(x) for x in args.shard_sweep.split(",") if x]
    sweep = shard_sweep(Corpus, time_plan, shards, records, multipliers, *parse_topology(args.sweep_topology),
                        args.repeats) if multipliers else []
    return {"rows": rows, "elastic": el, "built_s": built, "shards": shards, "records": records,
            "requests": pass_requests(plan_top, planner_top), "token_shares": [t / sum(tokens) for t in tokens],
            "pass_tokens": args.pass_tokens, "rank_tokens_s": args.rank_tokens_s, "sweep": sweep,
            "sweep_topology": args.sweep_topology, "requests_topology": args.requests_topology,
            "total_records": [int(m.num_records) for m in corpus.manifests],
            "total_tokens": [int(m.columns["num_tokens"].sum()) for m in corpus.manifests]}


def table(res: dict) -> list[str]:
    names = NAMES[: len(res["shards"])]
    head = ("| R x W | global workers | plan time, s (CPU s) | index reads | "
            + " | ".join(f"{n} max/mean (dropped)" for n in names)
            + " | overall max/mean | target met | steps/pass | ranks agree | global state (bytes) | per worker |")
    lines = [head, "|" + "---|" * (10 + len(names) - 1)]
    for r in res["rows"]:
        cells = [f"{v:.4f}" + ("" if a else " (n/a)") + f" ({d:.1%})"
                 for v, a, d in zip(r["imbalance"], r["applies"], r["dropped"])]
        agree = r["agree"]
        lines.append(
            f"| {r['topology']} | {r['workers']:,} | {r['plan_s']:.3f} ({r['plan_cpu']:.3f}) | {r['reads']:,} | "
            + " | ".join(cells)
            + f" | {r['overall']:.4f} | {'yes' if r['target_ok'] else 'no'} | {r['steps']:,} | "
            f"{'yes' if agree['agree'] else 'NO'} ({len(agree['ranks'])} ranks) | {r['state_bytes']:,} | "
            f"{r['state_bytes'] / r['workers']:,.0f} |"
        )
    return lines


def elastic_lines(el: dict) -> list[str]:
    ok = el["replan_s"] < TARGET_REPLAN
    return [
        "| measure | value |", "|---|---|",
        f"| saved work: record ranges / windows' rests (documents in them) | {el['ranges']:,} / "
        f"{el['windows']:,} ({el['window_docs']:,}) |",
        f"| `remaining_plan` {el['old']} -> {el['new']} (median) | {el['replan_s']:.3f} s "
        f"(target < {TARGET_REPLAN:.0f} s: {'met' if ok else 'missed'}) |",
        f"| steps left / token max/mean over new workers | {el['steps']:,} / {el['imbalance']:.4f} |",
        f"| window records read from indexes for `work_left` (in memory) | {el['window_reads_s']:.3f} s |",
        f"| global state after the elastic resume (`remaining` holds the work) | {el['state_bytes']:,} bytes |",
    ]


def machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.machine()} with {os.cpu_count()} CPUs (shared; load average {load:.1f} at the end), "
            f"Python {platform.python_version()}, numpy {np.__version__}")


def section(res: dict, command: str) -> str:
    names = NAMES[: len(res["shards"])]
    corpus = ", ".join(f"{n}: {s:,} shards, {r:,} records, {t / 1e9:.1f}B tokens"
                       for n, s, r, t in zip(names, res["shards"], res["total_records"], res["total_tokens"]))
    el = res["elastic"]
    return "\n".join([
        "## Shard plan, global state and elastic re-plan at scale",
        "",
        f"`{command}`, {datetime.date.today().isoformat()}, {machine()}.",
        "",
        f"Synthetic corpus in memory (no shard files; see the tool's docstring): {corpus}. "
        "Plan of pass 0 with exact counts, batch 8 x 2048, concat packing, fresh planner per run "
        "(its index reads are in-memory slices here, one ranged GET each in production). "
        f"Imbalance: max/mean tokens over global workers; the {TARGET_IMBALANCE} target applies "
        f"where a stream has at least {RECORDS_PER_WORKER}x more records than workers ((n/a) where not). "
        "Ranks agree: the plan computed by a sample of ranks, each in its own process, has the same "
        "steps and the same digest. Global state: bytes of the packed state's JSON.",
        "",
        *table(res),
        "",
        *cut_lines(res["rows"], names),
        *sweep_lines(res),
        "Start-up, from the planner: the record-index GETs a rank makes to plan pass 0 computing the plan "
        "alone (every shard a cut falls in; every rank did) and shared (`planning/shared.py`: each rank its own "
        "cuts' shards, then one all-gather of cuts and counts), and the job's requests before its first batch "
        "(the manifests, read once by rank 0 and broadcast; the plan's index GETs; each worker's first shard "
        "index and first fetch unit a stream). Measured on real ranks up to 8: the `startup` section.",
        "",
        *startup_lines(res["rows"]),
        "",
        *requests_lines(res, names),
        f"Elastic re-plan: the work left by a {el['old']} job saved halfway through pass 0 "
        f"(shuffle windows of {el['window']} records), re-planned over {el['new']}:",
        "",
        *elastic_lines(el),
        "",
        *notes(res, NAMES, TARGET_IMBALANCE),
        "",
        "![plan time and imbalance](img/plan_scale.png)",
    ])


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="1x1,8x8,64x8,256x8,512x8,1024x8,4096x8", help="R x W list")
    parser.add_argument("--shard-sweep", default="0.5,1,2,4", help="shard multipliers (records per shard divided "
                        "by them) timed at --sweep-topology; empty: none")
    parser.add_argument("--sweep-topology", default="1024x8")
    parser.add_argument("--requests-topology", default="1024x8", help="R x W whose requests are estimated")
    parser.add_argument("--pass-tokens", type=float, default=10e12, help="tokens of the long pass the request "
                        "rates are estimated for")
    parser.add_argument("--rank-tokens-s", type=float, default=1e6, help="tokens a rank consumes per second")
    parser.add_argument("--shards", default="6000,3000,1000", help="shards per stream (web, code, books)")
    parser.add_argument("--records", default="2000,1500,100", help="mean records per shard, per stream")
    parser.add_argument("--elastic", default="1024x8:768x8", help="old:new topology of the re-plan")
    parser.add_argument("--window", type=int, default=512, help="shuffle window (records) of the saved workers")
    parser.add_argument("--repeats", type=int, default=3, help="runs per timing; medians reported")
    parser.add_argument("--agree-ranks", type=int, default=4, help="ranks whose plans are computed apart")
    parser.add_argument("--out", default=os.path.join("docs", "benchmarks.md"), help="document to update")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs alone")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python tools/bench_plan_scale.py" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(
        sys.argv[1:] if argv is None else argv))
    res = run(args)
    text = section(res, command)
    print(text)
    if not args.no_write:
        from _benchdoc import publish

        publish("plan-scale", text, args.out, lambda path: plot(res, path, NAMES, TARGET_IMBALANCE), "plan_scale.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
