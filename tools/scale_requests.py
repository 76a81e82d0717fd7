"""Object-store requests at scale, from the plan (no I/O): what ``bench_plan_scale.py`` reports
beside plan times.

* ``startup_reads``: record-index GETs each rank makes to plan a pass, alone (every shard any
  cut falls in) and shared (``planning/shared.py``: the shards its own cuts fall in), plus the
  manifests (rank 0) and each worker's first reads (per stream: its first shard's index and
  first fetch unit).
* ``pass_requests``: GETs of a pass over this corpus at the default settings, walked over
  every worker's ranges the way the read-ahead groups frames (``source/readahead.py``): per
  shard piece one index GET, then fetch units of at most ``request_bytes`` compressed and a
  quarter of the stream's read-ahead share compressed plus decoded, the first units of each
  worker's plan growing from 256 KiB.
* ``settings_table``: the same arithmetic for a long pass (each worker reading gigabytes), per
  read-ahead setting: GETs per GB, GET/s per stream prefix at a consumption rate, and the
  burst when every worker starts at once.

Compressed bytes per token are a parameter (the synthetic corpus has no shard files): 1.2, as
measured on ``tools/bench_peers.py``'s corpus (60.3 MB of zstd shards for 50.0M uint16 tokens).
"""

from __future__ import annotations

import numpy as np

from streamforge.planning.layout import Layout
from streamforge.storage.config import REMOTE_READ_AHEAD, STREAM_READ_AHEAD_FLOOR
from streamforge.storage.prefetch import FIRST_UNIT_BYTES

BYTES_PER_TOKEN = 1.2  # compressed; zstd level 3 shards of tools/bench_peers.py's corpus
RAW_PER_TOKEN = 2  # uint16 tokens decoded
REQUEST_BYTES = 8 << 20  # StorageConfig.request_bytes
UNITS_IN_BUDGET = 4  # a unit holds at most a quarter of the read-ahead (source/readahead.py)
PREFIX_LIMIT = 5500  # GET/s a prefix takes before S3 answers SlowDown


def cut_shard_ids(layout: Layout, ks: np.ndarray) -> np.ndarray:
    """The shard each cut ``ks`` falls strictly inside, -1 where none (vectorized)."""
    out = np.full(len(ks), -1, np.int64)
    mid = np.flatnonzero((ks > 0) & (ks < layout.n))
    if len(mid) and len(layout.rec):
        j, _, inside = layout._locate(ks[mid])
        out[mid[inside]] = layout.order[j[inside]]
    return out


def startup_reads(manifests, names, world: int, workers: int, seed: int = 0) -> dict:
    """Record-index GETs to plan pass 0, per rank (max) and in all, alone and shared; with the
    manifests and each worker's first reads, the job's requests before its first batch."""
    n = world * workers
    alone = 0
    per_rank_shared = np.zeros(world, np.int64)
    for m, name in zip(manifests, names):
        layout = Layout(m.columns["num_records"], m.columns["num_tokens"], seed, name, 0, n)
        ids = cut_shard_ids(layout, np.arange(n + 1))
        alone += len(set(ids[ids >= 0].tolist()))
        rows = np.sort(np.stack([ids[r * workers: r * workers + workers + 1] for r in range(world)]), axis=1)
        distinct = (rows >= 0) & np.concatenate([np.ones((world, 1), bool), rows[:, 1:] != rows[:, :-1]], axis=1)
        per_rank_shared += distinct.sum(axis=1)
    streams = len(manifests)
    first = n * streams * 2  # each worker, each stream: its first shard's index and first unit
    shared_total = int(per_rank_shared.sum())
    return {"alone_per_rank": alone, "alone_total": alone * world, "shared_max": int(per_rank_shared.max()),
            "shared_total": shared_total, "manifests": streams, "first_reads": first,
            "job_alone": streams + alone * world + first, "job_shared": streams + shared_total + first}


def unit_bytes(prefetch_bytes: int, request_bytes: int, share: float, bytes_per_token: float = BYTES_PER_TOKEN) -> float:
    """The steady fetch unit (compressed bytes) of a stream with ``share`` of the read-ahead."""
    budget = max(min(prefetch_bytes, STREAM_READ_AHEAD_FLOOR), round(prefetch_bytes * share))
    held = budget / UNITS_IN_BUDGET * bytes_per_token / (bytes_per_token + RAW_PER_TOKEN)
    return max(1.0, min(request_bytes, held))


def ramp_units(fill: float, unit: float) -> int:
    """Units a new plan takes to fetch ``fill`` bytes: 256 KiB, doubling up to ``unit``."""
    count, size = 0, min(FIRST_UNIT_BYTES, unit)
    while fill > 0:
        fill -= size
        count += 1
        size = min(size * 2, unit)
    return count


def pass_requests(plan, planner, *, bytes_per_token: float = BYTES_PER_TOKEN, request_bytes: int = REQUEST_BYTES,
                  prefetch_bytes: int = REMOTE_READ_AHEAD[0]) -> dict:
    """GETs (index and data) and compressed GB of a pass over this corpus, per stream."""
    totals = [[planner.totals(s, r)[0] for r in per_worker] for s, per_worker in enumerate(plan.ranges)]
    whole = sum(map(sum, totals)) or 1
    out = []
    for s, per_worker in enumerate(plan.ranges):
        unit = unit_bytes(prefetch_bytes, request_bytes, sum(totals[s]) / whole, bytes_per_token)
        index = data = 0
        for ranges in per_worker:
            index += len(ranges)  # one index GET per shard piece (each worker process its own)
            data += ramp_units(sum(planner.totals(s, (p,))[0] for p in ranges) * bytes_per_token, unit) + max(
                0, len(ranges) - 1)  # a unit never spans shards: about one more per piece boundary
        out.append({"index": index, "data": data, "gb": sum(totals[s]) * bytes_per_token / 1e9, "unit": unit})
    gets = sum(x["index"] + x["data"] for x in out)
    gb = sum(x["gb"] for x in out)
    return {"streams": out, "gets": gets, "gb": gb, "per_gb": gets / gb if gb else 0.0,
            "worker_mb": gb * 1e3 / max(1, plan.num_global_workers)}


SETTINGS = (("default: 64 MiB read-ahead, 8 MiB requests", 64 << 20, 8 << 20),
            ("16 MiB read-ahead, 8 MiB requests", 16 << 20, 8 << 20),
            ("256 MiB read-ahead, 8 MiB requests", 256 << 20, 8 << 20),
            ("512 MiB read-ahead, 32 MiB requests", 512 << 20, 32 << 20))


def settings_table(*, world: int, workers: int, shares, shard_bytes: float, worker_gb: float,
                   tokens_per_rank_s: float = 1e6, bytes_per_token: float = BYTES_PER_TOKEN, prefixes: int = 1):
    """Per read-ahead setting: GETs per GB of a long pass (each worker reading ``worker_gb``
    in all, each stream its share: steady units, its ramp, one index GET a shard), GET/s per
    stream prefix at ``tokens_per_rank_s``, and the start burst (every worker's index GET and
    the units that fill its read-ahead share, at once) per prefix, each stream's shards spread
    over ``prefixes`` prefixes."""
    rows = []
    for label, prefetch, request in SETTINGS:
        per_stream = []
        for share in shares:
            unit = unit_bytes(prefetch, request, share, bytes_per_token)
            nbytes = worker_gb * 1e9 * share
            gets = ramp_units(nbytes, unit) + nbytes / shard_bytes + 1
            per_gb = gets / (nbytes / 1e9)
            rate = per_gb * world * tokens_per_rank_s * bytes_per_token * share / 1e9 / prefixes
            budget = max(min(prefetch, STREAM_READ_AHEAD_FLOOR), round(prefetch * share))
            burst = world * workers * (1 + ramp_units(min(budget, nbytes), unit)) / prefixes
            per_stream.append({"unit": unit, "per_gb": per_gb, "rate": rate, "burst": burst})
        rows.append({"label": label, "streams": per_stream})
    return rows


def settings_lines(rows, names, *, prefixes: int) -> list[str]:
    head = ("| read-ahead setting | " + " | ".join(f"{n}: unit MB / GETs per GB / GET/s" for n in names)
            + f" | start burst, GETs per prefix ({prefixes} prefix(es) a stream) | seconds of it at {PREFIX_LIMIT:,}/s |")
    lines = [head, "|" + "---|" * (len(names) + 3)]
    for r in rows:
        cells = [f"{x['unit'] / 1e6:.1f} / {x['per_gb']:.0f} / {x['rate']:,.0f}" for x in r["streams"]]
        burst = max(x["burst"] for x in r["streams"])
        lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {burst:,.0f} | {burst / PREFIX_LIMIT:.1f} |")
    return lines


# -- what bench_plan_scale.py adds to its section ----------------------------------------------
def shard_sweep(make_corpus, time_plan, shards, records, multipliers, world: int, workers: int, repeats: int):
    """Plan time at one topology over corpora of ``multipliers`` x the shards, each with as
    many fewer records a shard (the same records in all)."""
    rows = []
    for k in multipliers:
        corpus = make_corpus([max(1, int(s * k)) for s in shards], [max(1, int(round(r / k))) for r in records])
        seconds, cpu, reads, _, _ = time_plan(corpus, world, workers, repeats)
        rows.append({"shards": sum(int(m.num_shards) for m in corpus.manifests), "plan_s": float(np.median(seconds)),
                     "plan_cpu": float(np.median(cpu)), "reads": reads})
    return rows


def startup_lines(rows) -> list[str]:
    lines = ["| R x W | index GETs to plan, alone: per rank / all ranks | shared: busiest rank / all ranks | "
             "requests before the first batch, alone | shared | shared per rank |", "|---|---|---|---|---|---|"]
    for r in rows:
        s = r["startup"]
        world = int(r["topology"].split("x")[0])
        lines.append(f"| {r['topology']} | {s['alone_per_rank']:,} / {s['alone_total']:,} | {s['shared_max']:,} / "
                     f"{s['shared_total']:,} | {s['job_alone']:,} | {s['job_shared']:,} | {s['job_shared'] / world:,.1f} |")
    return lines


def requests_lines(res: dict, names) -> list[str]:
    req, topology = res["requests"], res["requests_topology"]
    world, workers = (int(x) for x in topology.split("x"))
    shares = res["token_shares"]
    worker_gb = res["pass_tokens"] * BYTES_PER_TOKEN / 1e9 / (world * workers)
    out = [f"Requests of a pass at the default settings (64 MiB read-ahead a worker, shared by the streams by "
           f"weight, 8 MiB largest request, a unit at most a quarter of a stream's read-ahead; {BYTES_PER_TOKEN} "
           f"compressed bytes a token): over this corpus at {topology}, {req['gets']:,} GETs for "
           f"{req['gb']:.1f} GB, **{req['per_gb']:,.0f} GETs per GB**, because each worker reads only "
           f"{req['worker_mb']:.1f} MB of it a pass (its index GETs and its read-ahead's first, small units "
           "are most of its requests). A long pass, each of the "
           f"{world * workers:,} workers reading {worker_gb:.2f} GB (a {res['pass_tokens'] / 1e12:g}T-token pass), "
           f"at {res['rank_tokens_s'] / 1e6:g}M tokens/s a rank ({world * res['rank_tokens_s'] * BYTES_PER_TOKEN / 1e9:.2f} "
           "GB/s of shards for the job), 64 MiB shards, each stream under one prefix:", ""]
    for prefixes in (1, 16):
        rows = settings_table(world=world, workers=workers, shares=shares, shard_bytes=64 << 20,
                              worker_gb=worker_gb, tokens_per_rank_s=res["rank_tokens_s"], prefixes=prefixes)
        out += settings_lines(rows, names, prefixes=prefixes) + [""]
    return out


def dropped_shares(plan, tokens: list[np.ndarray]) -> list[float]:
    """Per stream, the share of its tokens past the pass's last step, in concat packing: what
    ``PassPlan.dropped_tokens()`` counts, worker by worker (its tokens past its last batch),
    split over the streams in proportion to the worker's tokens of each (the tail of a worker's
    pass is a mixture like the rest of it)."""
    w, per_batch = plan.workers_per_rank, plan.batch_size * plan.seq_len
    delivered = np.array([plan.batches_of(g % w) * per_batch for g in range(plan.num_global_workers)], np.float64)
    held = np.array(plan.tokens, np.float64)
    dropped = np.maximum(0.0, held - delivered)
    raw = np.sum(tokens, axis=0)
    part = np.divide(dropped, held, out=np.zeros_like(held), where=held > 0)
    return [float((part * t).sum() / t.sum()) if t.sum() else 0.0 for t in tokens] if raw.size else []


def sweep_lines(res: dict) -> list[str]:
    """How plan time grows with workers (the table above) and with shards (this one)."""
    if not res["sweep"]:
        return []
    rows = res["rows"]
    out = [f"Plan time against shards at {res['sweep_topology']} (the same records, spread over more shards; "
           "medians):", "", "| shards | plan time, s (CPU s) | index reads |", "|---|---|---|"]
    out += [f"| {r['shards']:,} | {r['plan_s']:.3f} ({r['plan_cpu']:.3f}) | {r['reads']:,} |" for r in res["sweep"]]
    first, last = rows[1] if len(rows) > 1 else rows[0], rows[-1]
    grow = last["plan_cpu"] / first["plan_cpu"] if first["plan_cpu"] else float("nan")
    out += ["", f"Against workers: {first['workers']:,} -> {last['workers']:,} global workers "
            f"({last['workers'] / first['workers']:.0f}x) takes the plan's CPU time {grow:.1f}x "
            f"({first['plan_cpu']:.3f} -> {last['plan_cpu']:.3f} s).", ""]
    return out


def plot(res: dict, path: str, NAMES, TARGET_IMBALANCE) -> None:  # noqa: N803 - the tool's constants
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    x = [r["workers"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(x, [r["plan_s"] for r in rows], "o-")
    a.set(xscale="log", yscale="log", xlabel="global workers (R x W)", ylabel="plan time (s)",
          title="Planner.pass_plan, 3 streams, exact counts")
    for s, name in enumerate(NAMES[: len(res["shards"])]):
        b.plot(x, [r["imbalance"][s] for r in rows], "o-", label=name)
    b.plot(x, [r["overall"] for r in rows], "k--", label="overall (with EOS)")
    b.axhline(TARGET_IMBALANCE, color="grey", lw=0.8, ls=":", label=f"target {TARGET_IMBALANCE}")
    b.set(xscale="log", yscale="log", xlabel="global workers (R x W)", ylabel="max / mean tokens",
          title="token imbalance between global workers")
    b.legend(fontsize=8)
    from _benchdoc import save_figure

    save_figure(fig, path)


def notes(res: dict, NAMES, TARGET_IMBALANCE) -> list[str]:  # noqa: N803 - the tool's constants
    """What the figures say, with the reasons for missed targets."""
    out = []
    missed = [(r["topology"], NAMES[s], v) for r in res["rows"]
              for s, (v, a) in enumerate(zip(r["imbalance"], r["applies"])) if a and v >= TARGET_IMBALANCE]
    if missed:
        out += ["", f"Imbalance: the target is missed in {len(missed)} (topology, stream) case(s): "
                + ", ".join(f"{t} {n} ({v:.4f})" for t, n, v in missed) + ". The cuts are exact (each at the "
                "record boundary nearest its token quantile, from the record lengths of the shard it falls "
                "in), so what is left is record granularity: a worker is off its share by up to half a "
                "record at each of its two cuts, and one long document of a heavy-tailed stream is more than 1% "
                "of a worker's share once workers are many (code: lognormal sigma 1.2 over 4.5M records, "
                "so documents of several hundred thousand tokens; books: about 200 records per worker at "
                "512 workers). Token cuts (`cuts=\"tokens\"`, the second table) cut inside documents and remove it."]
    el = res["elastic"]
    out += ["", f"Elastic: the saved work lists each saved worker's window rest as one entry (its record "
            f"ranges, shuffle key, position and the tokens it holds), {el['windows']:,} entries for "
            f"{el['window_docs']:,} documents here, so the re-plan's cost and the state's size grow with "
            "the number of workers and ranges, not with the documents waiting in windows."]
    return out
