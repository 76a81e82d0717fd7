"""The report: the throughput, scale, resume, targets and formats tables, the peers section of
docs/benchmarks.md, and its plot."""

from __future__ import annotations

import os
import platform

from _benchdoc import spread

from .measure import systems_at
from .settings import (BATCH, CEILINGS, EQUAL, EQUAL_FIELDS, EQUAL_READ_AHEAD, EQUAL_SHUFFLE, M, NAMES, POSITIONS,
                       SYSTEMS, storage_name)
from .targets import bound_note, case_stats, med, targets_table
from .workarounds import NOTES as WORKAROUNDS


def row_label(system: str, workers: int, backend: str, args) -> str:
    if system in CEILINGS:
        return NAMES[system]
    return f"{NAMES[system]} | {workers} | {storage_name(backend, args.latency_ms, args.bandwidth_mbps)}"


def throughput_table(res: dict, args) -> list[str]:
    lines = ["| system | workers | storage | tokens/s, M (min-max) | x streamforge | CPU-s per 1B tokens | "
             "first batch, s | peak RSS, MiB (tree) | S3 requests per GB read (MB read) |",
             "|---|---|---|---|---|---|---|---|---|"]
    runs, errors = res["runs"], res["errors"]
    base = {}
    for (system, w, b), rs in runs.items():
        if system == "streamforge" and rs:
            base[w, b] = med(case_stats(rs)["rate"])
    for (system, w, b), rs in runs.items():
        if system in CEILINGS:
            label = f"{NAMES[system]} | 0 | local disk"
        else:
            label = row_label(system, w, b, args)
        if not rs:
            lines.append(f"| {label} | not runnable: {errors.get((system, w, b), 'no result')} | | | | | |")
            continue
        st = case_stats(rs)
        ref = base.get((w, b)) if system not in CEILINGS else base.get((0, "local"))
        ratio = f"{med(st['rate']) / ref:.2f}" if ref else "-"
        first = spread(st["first"], fmt="{:.3f}") if st["first"] else "-"
        rss = spread(st["rss"], 2**20, "{:.0f}") if st["rss"] else "-"
        reqs = f"{spread(st['req_per_gb'], fmt='{:.0f}')} ({med(st['read_mb']):.0f})" if st["req_per_gb"] else "-"
        lines.append(f"| {label} | {spread(st['rate'], M)}{failed_runs(rs, errors.get((system, w, b)), args)} | "
                     f"{ratio} | {spread(st['cpu_per_b'], fmt='{:.0f}')} | {first} | {rss} | {reqs} |")
    return lines


def failed_runs(rs: list, error: str | None, args) -> str:
    """What a row leaves out: the runs of a case that failed, with the last one's error."""
    if error is None or len(rs) >= args.repeats:
        return ""
    return f"; {len(rs)} of {args.repeats} runs, the others failed: {error}"


def scale_table(results: dict, args) -> list[str]:
    sizes = sorted(results)
    head = " | ".join(f"{t / M:g}M tokens" for t in sizes)
    lines = [f"| system | workers | storage | {head} | largest / main |", "|---" * (4 + len(sizes)) + "|"]
    keys = [k for k in results[sizes[0]]["runs"] if k[0] not in CEILINGS]
    for key in keys:
        rates = []
        for t in sizes:
            rs = results[t]["runs"].get(key) or []
            rates.append(med(case_stats(rs)["rate"]) if rs else None)
        cells = " | ".join(f"{r / M:.1f}M" if r else ("not run" if key[0] not in systems_at(args, t) else "-")
                           for r, t in zip(rates, sizes))
        grow = f"{rates[-1] / rates[0]:.2f}x" if rates[0] and rates[-1] else "-"
        lines.append(f"| {row_label(*key, args)} | {cells} | {grow} |")
    left_out = {}
    for key in keys:
        for t in sizes[1:]:
            if key[0] not in systems_at(args, t) and results[sizes[0]]["runs"].get(key):
                rate = med(case_stats(results[sizes[0]]["runs"][key])["rate"])
                left_out.setdefault((key[0], t), []).append(t / rate)
    if left_out:
        lines += ["", "Not run at the larger size (`--large-systems`), with the pass one case would take there "
                  "at its tokens/s on the main corpus: " + "; ".join(
                      f"{NAMES[system]} at {t / M:g}M tokens, {min(secs):.0f}-{max(secs):.0f} s a pass"
                      for (system, t), secs in left_out.items()) + "."]
    return lines


def resume_table(res: dict, args) -> list[str]:
    head = " | ".join(f"at {f:.0%}" for f in POSITIONS)
    lines = [f"| system | fresh start: first batch, s | {head} |", "|---" * (2 + len(POSITIONS)) + "|"]
    for system, r in res["resume"].items():
        fresh = res["runs"].get((system, args.resume_workers, "local")) or []
        fresh_s = spread(case_stats(fresh)["first"], fmt="{:.3f}") if fresh else "-"
        if "error" in r:
            lines.append(f"| {NAMES[system]} | {fresh_s} | not runnable: {r['error']} | | |")
            continue
        cells = []
        for b in r["at"]:
            b = str(b) if str(b) in r["times"] else b
            if r["errors"].get(b):
                cells.append(f"failed: {r['errors'][b]}")
                continue
            exact = all(r["exact"][b])
            checked = min(r["checked"][b])
            cells.append(f"{spread(r['times'][b], fmt='{:.3f}')} s, batch {b}/{r['batches']}, "
                         f"{'exact' if exact else '**not exact**'} ({checked} batches checked)")
        lines.append(f"| {NAMES[system]} | {fresh_s} | " + " | ".join(cells) + " |")
    return lines




def formats_table(meta: dict) -> list[str]:
    lines = ["| system | format, as its own writer wrote it | files | MB on disk | write, s |", "|---|---|---|---|---|"]
    kinds = {"streamforge": "tar/zstd shards (`ShardWriter`, 16 MiB, zstd level 3), one record per document",
             "grain": "ArrayRecord files (`ArrayRecordWriter(path, 'group_size:1')`, zstd:3 per record), a new "
                      "file each 16 MiB of records, one record per document",
             "litdata-zstd": "`litdata.optimize(..., item_loader=TokensLoader(), compression='zstd')`, 16 MB chunks, "
                             "one item per document",
             "litdata-raw": "`litdata.optimize(..., item_loader=TokensLoader())`, 16 MB chunks, one item per document",
             "mosaic": "`MDSWriter(columns={'tokens': 'bytes'}, size_limit=16 MiB)`, uncompressed, one sample "
                       "per 2049-token block",
             "webdataset": "`wds.ShardWriter(maxsize=16 MiB)` tar, uncompressed, one sample per 2049-token block"}
    for system, f in meta["formats"].items():
        if "error" in f:
            lines.append(f"| {NAMES[system]} | not written: {f['error']} | | | |")
        else:
            lines.append(f"| {NAMES[system]} | {kinds[system]} | {f['files']} | {f['bytes'] / M:.1f} | "
                         f"{f['write_s']:.1f} |")
    return lines


def plot_peers(res: dict, path: str, title: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]
    systems = [s for s in SYSTEMS if any(k[0] == s for k in runs)]
    order = {"local": 0, "s3": 1, "s3-latency": 2}
    configs = sorted({(w, b) for (s, w, b) in runs if s not in CEILINGS}, key=lambda c: (order[c[1]], c[0]))
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / max(1, len(configs))
    for i, (w, b) in enumerate(configs):
        vals, lo, hi = [], [], []
        for s in systems:
            rs = runs.get((s, w, b)) or []
            r = [x / M for x in case_stats(rs)["rate"]] if rs else [0.0]
            vals.append(med(r))
            lo.append(med(r) - min(r))
            hi.append(max(r) - med(r))
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(systems))]
        bars = ax.bar(xs, vals, width, yerr=[lo, hi], capsize=2,
                      label=f"{w} workers, {storage_name(b, args.latency_ms, args.bandwidth_mbps)}")
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "n/a" for v in vals], fontsize=7)
    for c, style in zip(CEILINGS, (":", "-.", "--")):
        rs = runs.get((c, 0, "local")) or []
        if rs:
            ax.axhline(med(case_stats(rs)["rate"]) / M, color="gray", linestyle=style, linewidth=1,
                       label=f"{NAMES[c]} ({med(case_stats(rs)['rate']) / M:.0f}M)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(systems)), [NAMES[s].replace(" + ", "\n+ ").replace(", ", ",\n") for s in systems],
                  fontsize=8)
    ax.set_ylabel("tokens/s (millions, log), median; bars: min-max")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    from _benchdoc import save_figure

    save_figure(fig, path)


def peers_section(results: dict, metas: dict, args, run: dict) -> str:
    from streamforge.storage.config import LOCAL_READ_AHEAD, REMOTE_READ_AHEAD, TRAINER_READ_AHEAD, spare_core

    cores = os.cpu_count() or 1
    worker_ahead = f"{LOCAL_READ_AHEAD[0] >> 20} MiB" if spare_core(cores, 2, 1) else "none"

    main = min(results)
    res, meta = results[main], metas[main]
    command, load = run["command"], run["load"]
    vers = ", ".join(f"{k} {v}" for k, v in run["versions"].items())
    large = [t for t in sorted(results) if t != main]
    sizes_text = ", ".join(f"{metas[t]['documents']:,} documents, {metas[t]['tokens']:,} tokens" for t in large)
    lines = [
        "## streamforge next to Grain, LitData, MosaicML Streaming and WebDataset (`tools/bench_peers.py`)", "",
        f"`{command}`, {run['date']}, {platform.machine()} with {os.cpu_count()} CPUs "
        f"(shared with other work; load average {load} at the end), Python {platform.python_version()}.", "",
        f"Versions: {vers}.", "",
        f"Corpus: {meta['documents']:,} documents, {meta['tokens']:,} tokens (plus one EOS each), lognormal "
        "lengths (median 600, sigma 1.0), ids `zipf(1.3) % 50256`, one deterministic generator; every "
        "system wrote it in its own format with its own writer, 16 MiB shards or chunks:", "",
        *formats_table(meta), "",
        f"The job: one pass of packed 2049-token int64 blocks in batches of {BATCH}. streamforge "
        "(`PackedTokenDataset(url, seq_len=2048, seed=0)`, `StreamingLoader(batch_size=8)`) delivers its full "
        "batch contract: input_ids, labels, position_ids, doc_ids, source_ids, documents shuffled in "
        "8192-document windows (the first windows of each pass growing from 256), default read-ahead "
        f"(local files: {TRAINER_READ_AHEAD[0] >> 20} MiB on one fetch thread in the training process, "
        f"{LOCAL_READ_AHEAD[0] >> 20} MiB in a DataLoader worker with two cores of its own and none in one without: "
        f"{worker_ahead} for each of 2 workers on {cores} cores; S3 {REMOTE_READ_AHEAD[0] >> 20} MiB on four), S3 read through obstore's client in the "
        "training process and over signed HTTP requests (`storage/s3http.py`) in forked workers (`StorageConfig.client='auto'`, docs/storage.md); **the peers deliver bare `[8, 2049]` int64 token blocks** "
        "(Grain as torchtitan builds it: `MapDataset.source(ArrayRecordDataSource).shuffle(0)`, "
        "`to_iter_dataset(ReadOptions(num_threads=4, prefetch_buffer_size=64))`, `ConcatThenSplitIterDataset` "
        "into 2049-token rows, `batch(8, drop_remainder=True)`, `mp_prefetch(MultiprocessingOptions(num_workers=2))` "
        "with 2 workers; LitData's `TokensLoader(block_size=2049)` with `shuffle=True`; Mosaic's `shuffle=True`; "
        "WebDataset's shard shuffle and a 1000-block sample shuffle, seeded). tokens/s counts corpus tokens "
        "delivered (streamforge: non-padding positions; a peer: 2049 per block) over the seconds from "
        "building the loader to the end of the pass, imports excluded (the system's modules and, from S3, "
        "the client it reads with: s3fs, obstore or boto3, imported before the clock starts). Each case runs "
        "in a fresh "
        f"process; medians of {args.repeats} runs (min-max), cases interleaved within each repeat. "
        "CPU-seconds: user + sys of the case process and its workers (psutil, sampled at the start and the "
        "end of the pass, reaped children included), per billion tokens; the CPU of the S3 server and of the proxy "
        "in front of it (each in a process of its own) is not counted. "
        "Peak RSS: the summed RSS of the case process and its descendants, sampled every 50 ms from the "
        "parent with psutil until the case prints its result (pages shared by forked workers count once per "
        "process; the interpreter's teardown after the result is left out). S3: moto on "
        "127.0.0.1 in a child of the tool, read through a proxy of the tool's own (`tools/peers/latency_proxy.py`, "
        "in another child; both started and stopped by the tool through their pids) that counts each request "
        "and the body bytes it sends. Loopback S3: the proxy adds nothing. "
        f"{storage_name('s3-latency', args.latency_ms, args.bandwidth_mbps)}: the proxy waits "
        f"{args.latency_ms:g} ms before each response (time to first byte, as S3 in a region: 10-30 ms) and sends "
        f"each connection's bodies no faster than {args.bandwidth_mbps:g} MB/s (about what one connection to S3 "
        "carries); every client keeps its connections alive and reads in parallel as it would from S3. "
        "Requests per GB read: the requests the proxy saw (every method) over the body bytes it sent, "
        "what a bucket bills by. Ratios: tokens/s over streamforge's "
        "with the same workers and storage (ceilings: over streamforge's with 0 workers, local disk).", "",
        "![tokens/s per system](img/peers_throughput.png)", "",
        *throughput_table(res, args), "",
        f"{NAMES[EQUAL]}: `StreamingLoader(fields={EQUAL_FIELDS!r})` (the two tensors a peer's int64 block "
        f"stands for), `shuffle_buffer={EQUAL_SHUFFLE}` (about the 2M tokens of WebDataset's 1000-block "
        f"sample buffer) and `StorageConfig(prefetch_bytes={EQUAL_READ_AHEAD})` (no read-ahead: WebDataset "
        "reads each tar in the iterating thread through an 8 KiB file buffer, gopen's default): equal output at "
        "equal settings, where its memory is compared (docs/storage.md says what each knob buys).", "",
    ]
    if large:
        lines += [
            "Start-up against steady state: the same cases on a corpus 10x larger, written the same way "
            f"({sizes_text}; tokens/s, medians); "
            "a system whose fixed costs (worker start, index reads, first downloads) matter gains most.", "",
            *scale_table(results, args), "",
        ]
    if res["resume"]:
        lines += [
            f"Resume with each system's own mechanism, {args.resume_workers} workers, local disk: a fresh process "
            "builds the loader, loads the state saved after that many batches of an uninterrupted pass and takes "
            f"the first batch (timed, median (min-max) of {args.repeats}); the next {args.resume_check} batches "
            "(or the rest of the pass) are compared with the uninterrupted pass's, bit for bit. Mechanisms: "
            "streamforge `loader.state_dict()`/`load_state_dict()`; Grain's iterator `get_state()`/`set_state()`; "
            "LitData's and Mosaic's "
            "`StreamingDataLoader.state_dict()`/`load_state_dict()`; WebDataset in torchdata's "
            "`StatefulDataLoader` (WebDataset keeps no state of its own, so the loader replays the "
            "samples already seen to get back to the position).", "",
            *resume_table(res, args), "",
        ]
    lines += [
        "The targets, each measured in this run (a bound is a ceiling, not a target):", "",
        *targets_table(res, args, {t: results[t] for t in large}), "",
        "The stall target (20 ms steps, 2 workers, S3 at 25 ms: < 1% stall, no wait over 100 ms) is "
        "measured by `tools/bench_stall.py --latency-ms 25 --bandwidth-mbps 100`, in its own section.", "",
        *bound_note(res),
        "Workarounds, all confined to the benchmark's own processes (`tools/peers/workarounds.py`):", "",
        *(f"- {note}" for note in WORKAROUNDS),
    ]
    return "\n".join(lines)

