"""streamforge alone, how the cost grows: tokens/s and peak RSS against shard size, number of
streams and shuffle buffer; time to first batch against shards in the manifest. Each point runs
in a fresh process; the corpora are built once under the workdir."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import time

import numpy as np

from _benchdoc import spread

from .corpus import documents, ensure_flat
from .harness import ChildFailed, run_child, tree_cpu
from .report import med
from .settings import BATCH, BLOCK, EOS, M, SEQ_LEN, SHARD_MIB, VOCAB


GROWTH_SHARD_MIB = (4, 16, 64, 256)
GROWTH_STREAMS = (1, 3, 10, 30)
GROWTH_BUFFERS = (256, 2048, 8192, 32768)
GROWTH_SHARDS = (10, 100, 1000, 10000, 100000)


def growth_child(spec: dict) -> dict:
    """One streamforge pass (or only its first batch) over ``spec["streams"]``."""
    from streamforge import PackedTokenDataset, Stream, StreamingLoader  # imported before the clock

    cpu0 = tree_cpu()
    start = time.perf_counter()
    streams = [Stream(url, weight=w, name=f"s{i}") for i, (url, w) in enumerate(spec["streams"])]
    dataset = PackedTokenDataset(streams, seq_len=SEQ_LEN, seed=0, shuffle_buffer=spec.get("shuffle_buffer", 8192),
                                 eos_id=EOS)
    loader = StreamingLoader(dataset, batch_size=BATCH, num_workers=spec.get("workers", 0), device="cpu")
    tokens = batches = 0
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - start
            if spec.get("first_only"):
                break
        doc_ids = batch["doc_ids"]
        tokens += doc_ids.numel() if doc_ids[-1, -1] >= 0 else int((doc_ids >= 0).sum())
        batches += 1
    return {"seconds": time.perf_counter() - start, "first": first, "tokens": tokens, "batches": batches,
            "cpu": tree_cpu() - cpu0}


def write_streams(meta: dict, out: str, shard_size: str, num_streams: int) -> list[str]:
    """The corpus dealt round-robin into ``num_streams`` streamforge streams."""
    from streamforge import ShardWriter

    urls = [os.path.join(out, f"s{i}") for i in range(num_streams)]
    writers = [ShardWriter(u, shard_size=shard_size, eos_id=EOS, vocab_size=VOCAB) for u in urls]
    for i, doc in enumerate(documents(meta)):
        writers[i % num_streams].write(doc)
    for w in writers:
        w.close()
    return urls


def write_many_shards(out: str, num_shards: int) -> str:
    """A stream of ``num_shards`` one-record shards (tiny documents): a big manifest, little data."""
    from streamforge import ShardWriter

    rng = np.random.default_rng(0)
    size = max(64, -(-4 * BATCH * BLOCK // num_shards))  # enough tokens for a few batches
    with ShardWriter(out, shard_size=1, eos_id=EOS, vocab_size=VOCAB) as writer:
        for _ in range(num_shards):
            writer.write(rng.integers(0, EOS, size, dtype=np.int64).astype(np.uint16))
    return out


def growth_corpora(args) -> tuple[dict, dict]:
    """{(curve, x): [(url, weight), ...]} for every point, built once under the workdir."""
    from tqdm import tqdm

    meta = ensure_flat(os.path.join(args.workdir, f"growth-t{int(args.growth_tokens)}"), int(args.growth_tokens))
    root = os.path.join(meta["root"], "sf")
    done_path = os.path.join(root, "done.json")
    done = json.load(open(done_path)) if os.path.exists(done_path) else {}
    points = [("shard", m) for m in GROWTH_SHARD_MIB] + [("streams", n) for n in GROWTH_STREAMS]
    points += [("shards", n) for n in GROWTH_SHARDS if n <= args.growth_max_shards]
    out = {}
    for curve, x in tqdm(points, desc="growth corpora", leave=False):
        key = f"{curve}-{x}"
        if key not in done:
            path = os.path.join(root, key)
            shutil.rmtree(path, ignore_errors=True)
            if curve == "shard":
                urls = write_streams(meta, path, f"{x}MiB", 1)
            elif curve == "streams":
                urls = write_streams(meta, path, f"{SHARD_MIB}MiB", x)
            else:
                urls = [write_many_shards(path, x)]
            done[key] = urls
            os.makedirs(root, exist_ok=True)
            with open(done_path, "w") as f:
                json.dump(done, f)
        urls = done[key]
        # the mixture: stream i weighs i + 1 (the heaviest 30x the lightest at 30 streams)
        out[curve, x] = [(u, float(i + 1)) for i, u in enumerate(urls)]
    for b in GROWTH_BUFFERS:
        out["buffer", b] = out["shard", SHARD_MIB]
    return out, meta


def measure_growth(args) -> dict:
    from tqdm import tqdm

    corpora, meta = growth_corpora(args)
    results: dict = {k: [] for k in corpora}
    errors: dict = {}
    with tqdm(total=args.growth_repeats * len(corpora), desc="growth", leave=False) as bar:
        for _ in range(args.growth_repeats):
            for (curve, x), streams in corpora.items():
                spec = {"kind": "growth", "streams": streams, "first_only": curve == "shards",
                        "shuffle_buffer": x if curve == "buffer" else 8192}
                if (curve, x) not in errors:
                    try:
                        results[curve, x].append(run_child(spec, args.timeout))
                    except ChildFailed as e:
                        errors[curve, x] = str(e)
                bar.update()
    shards = {}
    for (curve, x), streams in corpora.items():
        from streamforge.source import ShardSource

        shards[curve, x] = sum(ShardSource.open(u).manifest.num_shards for u, _ in streams)
    return {"results": results, "errors": errors, "shards": shards, "meta": meta}


def plot_growth(g: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = g["results"]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
    panels = [("shard", "shard size (MiB)"), ("streams", "streams (mixture, weights 1..N)"),
              ("buffer", "shuffle buffer (documents)")]
    for ax, (curve, label) in zip(axes, panels):
        xs = sorted(x for c, x in res if c == curve and res[c, x])
        rate = [med([r["tokens"] / r["seconds"] for r in res[curve, x]]) / M for x in xs]
        rss = [med([r["rss"] for r in res[curve, x] if r.get("rss")] or [0]) / 2**20 for x in xs]
        ax.plot(xs, rate, "o-", color="C0")
        ax.set_xscale("log", base=2 if curve != "streams" else 10)
        ax.set_xlabel(label)
        ax.set_ylabel("tokens/s (M), 0 workers", color="C0")
        ax.set_ylim(bottom=0)
        twin = ax.twinx()
        twin.plot(xs, rss, "s--", color="C3")
        twin.set_ylabel("peak RSS (MiB)", color="C3")
        twin.set_ylim(bottom=0)
    ax = axes[3]
    xs = sorted(x for c, x in res if c == "shards" and res[c, x])
    ax.plot(xs, [med([r["first"] for r in res["shards", x]]) for x in xs], "o-", color="C2")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("shards in the manifest")
    ax.set_ylabel("time to first batch (s)")
    fig.suptitle("streamforge: how the cost grows (medians)", fontsize=10)
    from _benchdoc import save_figure

    save_figure(fig, path)


def growth_section(g: dict, args, command: str) -> str:
    res, meta = g["results"], g["meta"]
    lines = [
        "## streamforge: how the cost grows (`tools/bench_peers.py`, growth)", "",
        f"`{command}`, {datetime.date.today().isoformat()}, {platform.machine()} with {os.cpu_count()} CPUs "
        f"(shared), Python {platform.python_version()}. streamforge alone, 0 workers, local disk, one pass of "
        f"{BATCH}x{SEQ_LEN} full-contract batches over a {meta['tokens'] / M:.0f}M-token corpus (the peers "
        "comparison's generator), each point in a fresh process, medians of "
        f"{args.growth_repeats}; peak RSS summed over the process tree (psutil, every 50 ms, up to the point's result). Shard sizes are "
        "`ShardWriter(shard_size=...)` (raw token bytes per shard); streams split the corpus round-robin, "
        "stream i weighing i + 1; the many-shards manifests hold one record per shard (64 tokens, more where "
        "the manifest is small, so that it holds a few batches) and only the first batch is taken.", "",
        "![how the cost grows](img/growth.png)", "",
        "| curve | point | shards | tokens/s, M (min-max) | first batch, s | peak RSS, MiB |", "|---|---|---|---|---|---|",
    ]
    units = {"shard": "{} MiB shards", "streams": "{} streams", "buffer": "shuffle buffer {}",
             "shards": "{} shards"}
    for (curve, x), rs in res.items():
        label = units[curve].format(x)
        if not rs:
            lines.append(f"| {curve} | {label} | {g['shards'][curve, x]} | not runnable: "
                         f"{g['errors'].get((curve, x), 'no result')} | | |")
            continue
        rate = "-" if curve == "shards" else spread([r["tokens"] / r["seconds"] for r in rs], M)
        rss = spread([r["rss"] for r in rs if r.get("rss")], 2**20, "{:.0f}") if rs[0].get("rss") else "-"
        firsts = [r["first"] for r in rs if r["first"] is not None]
        first = spread(firsts, fmt="{:.3f}") if firsts else "no batch"
        lines.append(f"| {curve} | {label} | {g['shards'][curve, x]} | {rate} | {first} | {rss} |")
    lines += ["", *growth_notes(g)]
    return "\n".join(lines)


def growth_notes(g: dict) -> list[str]:
    """What the curves show, with the measured ends of each, and why they bend where they do."""
    res = g["results"]

    def ends(curve, what):
        xs = sorted(x for c, x in res if c == curve and res[c, x])
        if len(xs) < 2:
            return None
        vals = []
        for x in (xs[0], xs[-1]):
            rs = res[curve, x]
            if what == "rate":
                vals.append(med([r["tokens"] / r["seconds"] for r in rs]) / M)
            elif what == "rss":
                vals.append(med([r["rss"] for r in rs if r.get("rss")] or [0]) / 2**20)
            else:
                vals.append(med([r["first"] for r in rs if r["first"] is not None] or [float("nan")]))
        return xs[0], xs[-1], vals[0], vals[1]

    out = ["Where the curves bend, and why:", ""]
    e, r, f = ends("shard", "rate"), ends("shard", "rss"), ends("shard", "first")
    if e and r:
        out.append(
            f"- **Shard size** ({e[0]} to {e[1]} MiB): tokens/s {e[2]:.1f}M to {e[3]:.1f}M, peak RSS {r[2]:.0f} to "
            f"{r[3]:.0f} MiB. The reader fetches zstd frames by byte range and decodes one frame at a time, so "
            "memory stays flat and tokens/s moves within the noise (see the min-max); the shards column shows "
            "where the corpus is a single shard, past which larger sizes change nothing.")
    e, r, f = ends("streams", "rate"), ends("streams", "rss"), ends("streams", "first")
    if e and r and f:
        out.append(
            f"- **Streams** ({e[0]} to {e[1]}, weights 1..N): tokens/s {e[2]:.1f}M to {e[3]:.1f}M, first batch "
            f"{f[2]:.3f} to {f[3]:.3f} s, peak RSS {r[2]:.0f} to {r[3]:.0f} MiB, on a corpus of "
            f"{g['meta']['tokens'] / M:.0f}M tokens. Profiled (cProfile, 0 workers): the token-share schedule "
            "hands over to another stream every document or two, so a batch holds a piece of a run for each "
            "stream it draws from, and each costs a reader call (about 10 us; the run's tokens stay views of the "
            "frames, regrouped by document in the schedule's order and copied once), where one stream takes "
            "one run a batch; the schedule itself is one merge of the streams' share ratios "
            "for every document their windows show, cut into batches (`Interleaver._planned`; docs/design.md "
            "gives what merging a document, then a batch at a time cost). The first batch "
            "waits for the first window of every stream its documents come from (at the start every ratio "
            "is 0, so the first documents come from as many streams), and each stream holds its own shuffle "
            "window, so memory grows with N; the read-ahead does not, as the streams share one budget "
            "(docs/storage.md).")
    e, r, f = ends("buffer", "rate"), ends("buffer", "rss"), ends("buffer", "first")
    if e and r and f:
        out.append(
            f"- **Shuffle buffer** ({e[0]} to {e[1]} documents): tokens/s {e[2]:.1f}M to {e[3]:.1f}M, first "
            f"batch {f[2]:.3f} to {f[3]:.3f} s, peak RSS {r[2]:.0f} to {r[3]:.0f} MiB. The window holds that "
            "many documents, so the memory grows with it until the window holds the whole stream (the corpus "
            f"has {g['meta']['documents']:,} documents); tokens/s and the first batch move within the noise of "
            "this shared machine (see the min-max).")
    f = ends("shards", "first")
    xs = sorted(x for c, x in res if c == "shards" and res[c, x])
    if f:
        firsts = {x: med([r["first"] for r in res["shards", x] if r["first"] is not None] or [float("nan")])
                  for x in xs}
        steps = ", ".join(f"{x:,}: {firsts[x]:.3f} s" for x in xs)
        out.append(
            f"- **Shards in the manifest** ({steps}). Each shard here holds one record, and the first shuffle "
            "window holds 256 documents (the warm-up; windows grow to 8192), so the first batch reads one "
            "record, an index and a frame, from each of the first min(N, 256) shards of its plan: that is the "
            "rise up to a thousand shards. Past 256 shards the reads stop growing, and what still grows is "
            "the manifest itself and the pass's plan, which is the bend after ten thousand: the manifest's "
            "JSON holds a name and a digest a shard, and the plan a range a shard, which the plan, the "
            "reader and its read-ahead each keep (the peak RSS column). Each is built in one numpy step or "
            "one pass over a list, never a call a shard (docs/design.md, \"A manifest of many shards\"), "
            "with Python's garbage collector paused until the first batch: the objects built per shard would "
            "otherwise set it off, a full collection of every object in the process included (`collector.paused`). "
            "Real shards hold thousands of documents each, so a manifest of N shards costs far less than N "
            "records' worth of reads.")
    if max(xs, default=0) < max(GROWTH_SHARDS):
        out.append(f"- The {max(GROWTH_SHARDS):,}-shard point was not run (`--growth-max-shards {max(xs, default=0)}`); "
                   "writing its corpus takes about 20 s.")
    return out
