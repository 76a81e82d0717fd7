"""The targets of issue #39, each measured in one run of the tool: streamforge's figure, the
peer figure it is held against, the ratio and whether it is met; and the note on what bounds
the 0-worker throughput target."""

from __future__ import annotations

import statistics

from .settings import EQUAL, M, NAMES, PEERS, POSITIONS, storage_name

# the configurations of the throughput target: local 0 and 2 workers, S3 2 workers at both speeds
RATE_CASES = ((0, "local"), (2, "local"), (2, "s3"), (2, "s3-latency"))


def med(values) -> float:
    return float(statistics.median(values))


def case_stats(rs: list[dict]) -> dict:
    return {"rate": [r["tokens"] / r["seconds"] for r in rs],
            "cpu_per_b": [r["cpu"] / r["tokens"] * 1e9 for r in rs],
            "first": [r["first"] for r in rs if r["first"] is not None],
            "rss": [r["rss"] for r in rs if r.get("rss")],
            "req_per_gb": [r["requests"] / (r["read_bytes"] / 1e9) for r in rs if r.get("read_bytes")],
            "read_mb": [r["read_bytes"] / M for r in rs if r.get("read_bytes")]}


def _rate(res: dict, key) -> float | None:
    rs = res["runs"].get(key) or []
    return med(case_stats(rs)["rate"]) if rs else None


def _best_peer(res: dict, workers: int, backend: str, what: str = "rate", least: bool = False):
    """(system, median) of the peer with the highest ``what`` (the lowest with ``least``) in
    one configuration, or None when no peer ran there."""
    found = []
    for system in PEERS:
        rs = res["runs"].get((system, workers, backend)) or []
        values = case_stats(rs)[what] if rs else []
        if values:
            found.append((med(values), system))
    if not found:
        return None
    value, system = min(found) if least else max(found)
    return system, value


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "**missed**")


def _where(w: int, b: str, args) -> str:
    return f"{w} workers, {storage_name(b, args.latency_ms, args.bandwidth_mbps)}"


def bound_note(res: dict) -> list[str]:
    """What bounds the 0-worker throughput target, from this run's ceilings."""
    contract, zstd, best = _rate(res, ("contract", 0, "local")), _rate(res, ("zstd", 0, "local")), \
        _best_peer(res, 0, "local")
    if not (contract and zstd and best):
        return []
    one_core = 1 / (1 / contract + 1 / zstd)
    return [
        f"What bounds the 0-worker target: building the five tensors of the contract, with no decode, no "
        f"shuffle and no state, runs at {contract / M:.0f}M tokens/s on one core ({contract / best[1]:.2f}x "
        f"{NAMES[best[0]]}); with zstd decoding on the same core the two come to {one_core / M:.0f}M "
        f"({one_core / best[1]:.2f}x), and with the decoding moved to the second core, as the read-ahead does, "
        f"the contract alone is the bound. 1.5x the fastest peer is {1.5 * best[1] / contract:.0%} of that "
        "ceiling, before any shuffling, packing or state is paid for.", "",
    ]


def _throughput_rows(res: dict, args) -> list[tuple]:
    rows = []
    for w, b in RATE_CASES:
        ours, best = _rate(res, ("streamforge", w, b)), _best_peer(res, w, b)
        if ours and best:
            rows.append((f"tokens/s >= 1.5x the fastest peer, {_where(w, b, args)}", f"{ours / M:.1f}M",
                         f"{NAMES[best[0]]} {best[1] / M:.1f}M", f"{ours / best[1]:.2f}x", ours >= 1.5 * best[1]))
    contract, best0 = _rate(res, ("contract", 0, "local")), _best_peer(res, 0, "local")
    if contract and best0:
        rows.append(("bound: the full contract from a flat memmap (no decode, no shuffle, one core) / the "
                     "fastest peer, 0 workers, local", f"{contract / M:.1f}M", f"{best0[1] / M:.1f}M",
                     f"{contract / best0[1]:.2f}x", None))
    return rows


def _cpu_rows(res: dict, args) -> list[tuple]:
    rows = []
    for (system, w, b), rs in res["runs"].items():
        if system != "streamforge" or not rs:
            continue
        lowest = _best_peer(res, w, b, "cpu_per_b", least=True)
        if lowest:
            ours = med(case_stats(rs)["cpu_per_b"])
            rows.append((f"CPU-s per 1B tokens <= the lowest peer's, {_where(w, b, args)}", f"{ours:.0f}",
                         f"{NAMES[lowest[0]]} {lowest[1]:.0f}", f"{ours / lowest[1]:.2f}x", ours <= lowest[1]))
    return rows


def _first_batch_rows(res: dict, args) -> list[tuple]:
    rows = []
    for w, b in sorted({(w, b) for (_, w, b) in res["runs"] if b != "local"}, key=lambda c: (c[1], c[0])):
        rs = res["runs"].get(("streamforge", w, b)) or []
        best = _best_peer(res, w, b, "first", least=True)
        if rs and best:
            ours = med(case_stats(rs)["first"])
            rows.append((f"first batch from S3 <= 0.5x the fastest peer's, {_where(w, b, args)}", f"{ours:.3f} s",
                         f"{NAMES[best[0]]} {best[1]:.3f} s", f"{ours / best[1]:.2f}x", ours <= 0.5 * best[1]))
    return rows


def _resume_rows(res: dict, args) -> list[tuple]:
    rows = []
    resume = res.get("resume") or {}
    ours_r = resume.get("streamforge") or {}
    for i, frac in enumerate(POSITIONS):
        if "at" not in ours_r or i >= len(ours_r["at"]):
            break
        ours = ours_r["times"].get(ours_r["at"][i]) or ours_r["times"].get(str(ours_r["at"][i]))
        peers, inexact = [], []
        for system in PEERS:
            r = resume.get(system) or {}
            if "at" not in r or i >= len(r["at"]):
                continue
            b = r["at"][i]
            times, exact = r["times"].get(b) or r["times"].get(str(b)), r["exact"].get(b) or r["exact"].get(str(b))
            if times and exact and all(exact):
                peers.append((med(times), system))
            elif times:
                inexact.append(NAMES[system])
        if ours and peers:
            best_t, best_s = min(peers)
            note = f" (not exact, left out: {', '.join(inexact)})" if inexact else ""
            rows.append((f"resume at {frac:.0%} <= 0.5x the fastest exact peer's, {args.resume_workers} workers{note}",
                         f"{med(ours):.3f} s", f"{NAMES[best_s]} {best_t:.3f} s", f"{med(ours) / best_t:.2f}x",
                         med(ours) <= 0.5 * best_t))
    return rows


def _memory_rows(res: dict) -> list[tuple]:
    rows = []
    lightest = _best_peer(res, 0, "local", "rss", least=True)
    for system, what in ((EQUAL, "equal output (input_ids + labels) and settings"), ("streamforge", "default settings")):
        rs = res["runs"].get((system, 0, "local")) or []
        if rs and lightest and case_stats(rs)["rss"]:
            ours = med(case_stats(rs)["rss"])
            rows.append((f"peak RSS <= the lightest peer's, 0 workers, local: {what}", f"{ours / 2**20:.0f} MiB",
                         f"{NAMES[lightest[0]]} {lightest[1] / 2**20:.0f} MiB", f"{ours / lightest[1]:.2f}x",
                         ours <= lightest[1]))
    return rows


def _worker_rows(res: dict, args, larger: dict) -> list[tuple]:
    rows = []
    for size, sized in [(None, res)] + sorted(larger.items()):
        for b in ("local", "s3", "s3-latency"):
            two, zero = _rate(sized, ("streamforge", 2, b)), _rate(sized, ("streamforge", 0, b))
            if two and zero:
                at = f", {size / M:g}M-token corpus" if size else ""
                rows.append((f"2 workers >= 0 workers, {storage_name(b, args.latency_ms, args.bandwidth_mbps)}{at}",
                             f"{two / M:.1f}M", f"{zero / M:.1f}M", f"{two / zero:.2f}x", two >= zero))
    return rows


def targets_table(res: dict, args, larger: dict | None = None) -> list[str]:
    """Each target of the comparison, measured in this run on the main corpus; ``larger``
    (size: results) adds the workers target on the larger corpora."""
    rows = _throughput_rows(res, args) + _cpu_rows(res, args)
    ours0, zstd = _rate(res, ("streamforge", 0, "local")), _rate(res, ("zstd", 0, "local"))
    if zstd and ours0:
        rows.append(("0 workers, local >= 50% of raw zstd decoding of the same shards (one core)",
                     f"{ours0 / M:.1f}M", f"{zstd / M:.1f}M", f"{ours0 / zstd:.0%}", ours0 >= 0.5 * zstd))
    rows += _memory_rows(res) + _worker_rows(res, args, larger or {}) + _resume_rows(res, args)
    rows += _first_batch_rows(res, args)
    lines = ["| target | streamforge | against | ratio | |", "|---|---|---|---|---|"]
    lines += [f"| {t} | {a} | {b} | {r} | {_verdict(ok)} |" for t, a, b, r, ok in rows]
    return lines
