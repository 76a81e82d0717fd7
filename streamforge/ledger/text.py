"""Text for people from the plain-data reports of ``ledger_report`` (``--json`` prints those)."""

from __future__ import annotations

import datetime
from typing import Any

from .report import LIST_LIMIT


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _span(r: list[int] | None) -> str:
    return "none" if r is None else f"{r[0]:,}..{r[1]:,}"


def _more(items: list, lines: list[str]) -> None:
    if len(items) > LIST_LIMIT:
        lines.append(f"    ... and {len(items) - LIST_LIMIT:,} more (--json lists all)")


def format_check(report: dict[str, Any], url: str) -> str:
    led = report["ledger"]
    lines = [f"ledger {url}",
             f"  steps {_span(led['steps'])}: {led['rank_steps']:,} rank-steps, {led['pieces']:,} pieces, "
             f"{led['tokens']:,} tokens ({led['rolled_back_rank_steps']:,} rank-steps rolled back by restarts)"]
    if led.get("uncommitted_rank_steps"):
        lines.append(f"  {led['uncommitted_rank_steps']:,} rank-steps handed out but never committed (void)")
    if report.get("membership"):
        lines.append("  membership (from step: live participants): "
                     + ", ".join(f"{s:,}: {n}" for s, n in report["membership"]))
    lines.append(f"  restarts: {len(led['restarts'])} (generation: how it started)")
    for g in led["restarts"]:
        who = f"participant(s) {g['ranks']}" if g.get("scope") == "participant" else f"{g['world_size']} rank(s)"
        lines.append(f"    {'+'.join(map(str, g['generations']))}: {g['mode']} at step {g['resumed_at_step']:,}, "
                     f"{who}, {_when(g['time'])}")
    lines.append("")
    if report["ok"]:
        if report["exactly_once"] == "checked":
            lines.append("OK: no token was delivered twice")
        else:
            lines.append(f"OK: no step was recorded twice; tokens {report['exactly_once']}")
    else:
        lines.append(f"FAILED: {len(report['problems'])} problem(s)")
        lines += [f"  {p}" for p in report["problems"][:LIST_LIMIT]]
        _more(report["problems"], lines)
    if report["duplicates"]:
        lines.append("delivered twice (pass stream shard record tokens: first at, again at):")
        for d in report["duplicates"][:LIST_LIMIT]:
            first, again = d["first"], d["again"]
            reading = f"reading {d['reading']} " if d.get("reading") else ""
            lines.append(f"  pass {d['pass']} {d['stream']} {reading}shard {d['shard']} record {d['record']} "
                         f"tokens {d['tokens'][0]}..{d['tokens'][1]}: step {first['step']} rank {first['rank']} "
                         f"(gen {first['generation']}), again step {again['step']} rank {again['rank']} "
                         f"(gen {again['generation']})")
        _more(report["duplicates"], lines)
    _skipped_lines(report, lines)
    for p in report["passes"]:
        _pass_lines(p, lines)
    return "\n".join(lines)


def _skipped_lines(report: dict[str, Any], lines: list[str]) -> None:
    lines.append("")
    skipped = report["skipped_steps"]
    lines.append(f"skipped steps (skip_steps): {len(skipped)} range(s)" + (":" if skipped else ""))
    for s in skipped[:LIST_LIMIT]:
        lines.append(f"  steps {s['steps'][0]:,}..{s['steps'][1] - 1:,}: {s['tokens']:,} tokens")
    _more(skipped, lines)
    damaged = report["damaged"]
    lines.append(f"damaged records skipped: {len(damaged)} range(s)" + (":" if damaged else ""))
    for d in damaged[:LIST_LIMIT]:
        lines.append(f"  {d.get('stream')} {d.get('shard')} records {d.get('start')}..{d.get('stop')}: "
                     f"{d.get('reason')}")
    _more(damaged, lines)


def _pass_lines(p: dict[str, Any], lines: list[str]) -> None:
    lines.append("")
    lines.append(f"pass {p['pass']}: steps reached {_span(p['steps_reached'])}"
                 + (f" of {_span(p['planned_steps'])}" + ("" if p["complete"] else " (incomplete)")
                    if "planned_steps" in p else ""))
    lines.append(f"  delivered {p['delivered_tokens']:,} tokens, skipped {p['skipped_tokens']:,}")
    if "planned_tokens" in p:
        lines.append(f"  planned {p['planned_tokens']:,} tokens; not delivered {p['not_delivered_tokens']:,} "
                     f"(the plan drops {p['dropped_tokens']:,}; drop bound {p['drop_bound']:,})")
    partial = p["partial_documents"]
    lines.append(f"  documents cut short (never reached their end): {partial['count']:,}")
    for d in partial["listed"][:LIST_LIMIT]:
        lines.append(f"    {d['stream']} shard {d['shard']} record {d['record']}: delivered to token "
                     f"{d['delivered_to']:,} (step {d['step']}, rank {d['rank']})")
    _more(partial["listed"], lines)
    for name, r in p.get("records_never_reached", {}).items():
        if "unknown" in r:
            lines.append(f"  {name}: {r['unknown']}")
        else:
            lines.append(f"  {name}: {r['never_reached']:,} of {r['records']:,} {r['counts']} never reached "
                         f"({r['shards_with_untouched']:,} shard(s))")


def format_diff(report: dict[str, Any], a: str, b: str) -> str:
    if report["identical"]:
        steps = report["steps"]
        tail = "" if steps[0] == steps[1] else f" (A covers {_span(steps[0])}, B {_span(steps[1])})"
        return f"identical over {report['common_steps']:,} steps{tail}"
    lines = [f"first difference: step {report['step']:,}, rank {report['rank']}, piece {report['piece']}"]
    for label, url, ranks in (("A", a, report["a"]), ("B", b, report["b"])):
        lines.append(f"{label} {url}:")
        lines += _piece_lines(ranks, "  ") or ["  (no record of this step)"]
    return "\n".join(lines)


def format_show(report: dict[str, Any]) -> str:
    if not report["ranks"]:
        return f"step {report['step']:,}: not in the ledger (or rolled back)"
    head = f"step {report['step']:,} (pass {report['pass']}, generation {report['generation']})"
    if report.get("skipped"):
        head += ": skipped (skip_steps), not trained on"
    return "\n".join([head] + _piece_lines(report["ranks"], ""))


def _piece_lines(ranks: list[dict[str, Any]], indent: str) -> list[str]:
    lines = []
    for r in ranks:
        lines.append(f"{indent}rank {r['rank']}")
        row = None
        for p in r["rows"]:
            label = f"row {p['row']}" if p["row"] != row else ""
            row = p["row"]
            line = (f"{indent}  {label:<8} col {p['col']:>6}  {p['stream']:<12} "
                    f"{'reading ' + str(p['reading']) + ' ' if 'reading' in p else ''}shard {p['shard']:>5} "
                    f"record {p['record']:>8}  tokens {p['tokens'][0]:>7}..{p['tokens'][1]:<7}"
                    + ("  continues" if p["continues"] else ""))
            lines.append(line.rstrip())
    return lines
