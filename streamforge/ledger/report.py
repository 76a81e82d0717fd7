"""What a data-order ledger proves: ``check``, ``diff`` and ``show`` over ``ledger.Ledger``.

``check`` is exactly-once delivery as interval arithmetic: within a pass, the pieces of one
(stream, shard, record) are token intervals ``[token_start, token_start + length)``, and no
two may overlap. ``find_overlaps`` sorts all pieces once by (key, start) and compares each
start with the running maximum of the ends before it in its group: O(n log n), vectorized
(about a second for 10^7 pieces). Skipped steps count as consumed (the loader builds them),
so their tokens must not come back either.

A stream read more than once per pass (``Stream(repeat=k)``, ``upsample=True``) records
reading ``r`` of shard ``s`` as shard ``r * S + s`` (``planning/readings.py``; the meta's
stream entry holds ``repeat`` and ``shards``): ``with_readings`` splits it into a ``reading``
and the shard, so a record delivered once in each reading is exactly once, and twice in one
reading a duplicate.

Each function returns plain data (for ``--json``); ``format_*`` turn it into text.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..pipeline.batch import RowBatch, split_at_rows
from ..planning.steps import StepSchedule
from .store import Ledger

LIST_LIMIT = 20  # entries of a list printed in text output (all of them go to --json)


# -- intervals ---------------------------------------------------------------------------------
def find_overlaps(keys: list[np.ndarray], start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(i, j)`` of intervals with equal keys where ``i`` overlaps the earlier ``j``.

    Every interval that overlaps some interval sorted before it (by key, then start) appears
    once as ``i``, with ``j`` the earlier interval reaching furthest. Empty intervals never
    overlap. Indexes are into the inputs."""
    start, end = np.asarray(start, np.int64), np.asarray(end, np.int64)
    live = np.flatnonzero(end > start)
    if len(live) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    keys = [np.asarray(k, np.int64)[live] for k in keys]
    s, e = start[live], end[live]
    order = np.lexsort([e, s] + keys[::-1])
    s, e = s[order], e[order]
    new_group = np.zeros(len(order), bool)
    new_group[0] = True
    for k in keys:
        k = k[order]
        new_group[1:] |= k[1:] != k[:-1]
    group = np.cumsum(new_group) - 1
    # running max of the ends within each group: lift group g by g * span so groups never mix
    lo = int(min(s.min(), 0))
    span = int(e.max()) - lo + 1
    if int(group[-1]) * span >= 2**62:  # pragma: no cover - beyond any real ledger
        raise OverflowError("too many groups for the vectorized overlap check")
    lifted = (e - lo) + group * span
    best = np.maximum.accumulate(lifted)
    holder = np.maximum.accumulate(np.where(lifted == best, np.arange(len(lifted)), 0))
    prev_end = best[:-1] - group[1:] * span + lo  # the furthest end before i in i's group
    hit = np.flatnonzero(~new_group[1:] & (s[1:] < prev_end)) + 1
    return live[order[hit]], live[order[holder[hit - 1]]]


# -- check -------------------------------------------------------------------------------------
def check(ledger: Ledger, manifests: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything ``streamforge ledger check`` reports; ``ok`` is False on any problem.

    ``manifests``: stream name -> ``Manifest`` (optional) to count records never reached."""
    steps, pieces = ledger.steps, with_readings(ledger)
    meta = ledger.meta
    infinite = bool(meta.get("infinite", False))
    names = ledger.stream_names
    problems = list(ledger.problems)
    problems += _step_problems(ledger)
    duplicates = [] if infinite else _duplicates(pieces, names)
    if duplicates:
        statistical = {g for r in ledger.restarts if r["mode"] == "statistical" for g in r["generations"]}
        across = sum(d["again"]["generation"] in statistical and d["first"]["generation"] != d["again"]["generation"]
                     for d in duplicates)
        note = (f" ({across} of them after a statistical resume, which approximates positions: "
                "docs/design.md)") if across else ""
        problems.append(f"{len(duplicates)} piece(s) deliver tokens already delivered in the same pass{note}")
    report = {
        "ok": False,
        "ledger": {
            "restarts": [_generation(r) for r in ledger.restarts],
            "steps": _range(steps["step"]),
            "rank_steps": int(len(steps["step"])),
            "rolled_back_rank_steps": int(len(ledger.rolled_back["step"])),
            "uncommitted_rank_steps": int(len(ledger.uncommitted.get("step", ()))),
            "pieces": int(len(pieces["step"])),
            "tokens": int(pieces["length"].sum()),
        },
        "membership": ledger.membership,
        "exactly_once": "not checked: infinite=True passes of each stream run on their own" if infinite else "checked",
        "problems": problems,
        "duplicates": duplicates,
        "skipped_steps": _skipped_steps(steps, pieces),
        "damaged": ledger.damaged,
        "passes": [] if infinite else _passes(ledger, pieces, manifests, names),
    }
    report["ok"] = not problems
    return report


def _generation(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r.get(k, "job") for k in ("generations", "mode", "resumed_at_step", "world_size", "ranks", "time",
                                         "scope")}


def _range(values: np.ndarray) -> list[int] | None:
    return [int(values.min()), int(values.max())] if len(values) else None


def _step_problems(ledger: Ledger) -> list[str]:
    """Steps recorded twice, before their generation's resume step, or missing inside the
    range the ledger covers."""
    steps, out = ledger.steps, []
    step, rank = steps["step"], steps["rank"].astype(np.int64)
    for r in ledger.restarts:
        mine = np.isin(steps["generation"], r["generations"])
        if r.get("scope") == "participant":  # participants' restarts may share a number
            mine &= np.isin(rank, r["ranks"])
        early = step[mine & (step < r["resumed_at_step"])]
        if len(early):
            out.append(f"generation {_names(r)} resumed at step {r['resumed_at_step']} but recorded steps "
                       f"{int(early.min())}..{int(early.max())}")
    out += _holes(ledger)
    uniq, counts = np.unique(np.stack([rank, step], axis=1), axis=0, return_counts=True)
    twice = uniq[counts > 1]
    if len(twice):  # runs of consecutive steps of one rank
        breaks = np.flatnonzero((np.diff(twice[:, 1]) != 1) | (np.diff(twice[:, 0]) != 0)) + 1
        for run in np.split(twice, breaks):
            r, a, b = int(run[0, 0]), int(run[0, 1]), int(run[-1, 1])
            inside = (rank == r) & (step >= a) & (step <= b)
            out.append(f"steps {a}..{b} of rank {r} are recorded more than once "
                       f"(generations {sorted(set(steps['generation'][inside].tolist()))})")
    return out


def _holes(ledger: Ledger) -> list[str]:
    """Steps inside each generation's effective range that some rank of it never recorded.
    The tail of the last generation is exempt: a killed job's ranks stop where they stop.
    Under a live membership, each step must hold as many participants as the history has live
    there (the last step exempt); a participant's restart is checked on its own ranks only."""
    steps, out = ledger.steps, []
    gens = ledger.restarts
    if ledger.membership and len(steps["step"]):
        out += _live_holes(steps, ledger.membership)
    for i, h in enumerate(gens):
        mine = np.isin(steps["generation"], h["generations"])
        if not mine.any():
            continue
        if h.get("scope") == "participant":
            mine &= np.isin(steps["rank"], h["ranks"])  # it stops where its participant leaves or dies
            for r in h["ranks"]:
                got = np.unique(steps["step"][mine & (steps["rank"] == r)])
                if len(got) and len(got) < int(got[-1]) - h["resumed_at_step"] + 1:
                    missing = np.setdiff1d(np.arange(h["resumed_at_step"], int(got[-1]) + 1), got)
                    out.append(f"generation {_names(h)}, participant {r}: {len(missing)} step(s) not recorded "
                               f"(first {int(missing[0])}, last {int(missing[-1])})")
            continue
        last_gen = i == len(gens) - 1
        for r in range(int(h["world_size"])):
            got = np.unique(steps["step"][mine & (steps["rank"] == r)])
            top = int(steps["step"][mine].max())
            if last_gen:
                top = int(got.max()) if len(got) else h["resumed_at_step"] - 1
            expected = top - h["resumed_at_step"] + 1
            if len(got) < expected:
                missing = np.setdiff1d(np.arange(h["resumed_at_step"], top + 1), got)
                out.append(f"generation {_names(h)}, rank {r}: {len(missing)} step(s) not recorded "
                           f"(first {int(missing[0])}, last {int(missing[-1])})")
    return out


def _live_holes(steps: dict[str, np.ndarray], history: list) -> list[str]:
    """Steps (the last one recorded aside) where fewer or more participants recorded than the
    membership history has live."""
    uniq = np.unique(np.stack([steps["step"].astype(np.int64), steps["rank"].astype(np.int64)], axis=1), axis=0)
    first, last = int(uniq[0, 0]), int(uniq[-1, 0])
    got = np.bincount(uniq[:, 0] - first, minlength=last - first + 1)
    at = np.arange(first, last + 1)
    starts = np.array([s for s, _ in history], np.int64)
    live = np.array([n for _, n in history], np.int64)[np.searchsorted(starts, at, side="right") - 1]
    bad = np.flatnonzero((got != live)[:-1])
    if not len(bad):
        return []
    s = int(at[bad[0]])
    return [f"{len(bad)} step(s) recorded by another number of participants than the membership history has "
            f"live (first: step {s}, {int(got[bad[0]])} recorded, {int(live[bad[0]])} live)"]


def _names(restart: dict[str, Any]) -> str:
    return "+".join(str(g) for g in restart["generations"])


def repeated_streams(ledger: Ledger) -> dict[int, tuple[int, float]]:
    """Stream index -> (its shards, its readings per pass), for the streams read more than once."""
    out = {}
    for i, entry in enumerate(ledger.meta.get("streams", [])):
        if isinstance(entry, dict) and "repeat" in entry and int(entry.get("shards", 0)) > 0:
            out[i] = (int(entry["shards"]), float(entry["repeat"]))
    return out


def with_readings(ledger: Ledger) -> dict[str, np.ndarray]:
    """The ledger's pieces with a ``reading`` column (0 for a stream read once) and each
    shard id of a repeated stream split into that reading and the stream's shard."""
    pieces = dict(ledger.pieces)
    reading = np.zeros(len(pieces["shard"]), np.int64)
    repeated = repeated_streams(ledger)
    if repeated:
        shard = pieces["shard"].astype(np.int64)
        for stream, (num_shards, _) in repeated.items():
            sel = pieces["stream"] == stream
            reading[sel], shard[sel] = np.divmod(shard[sel], num_shards)
        pieces["shard"] = shard
    pieces["reading"] = reading
    return pieces


def _duplicates(pieces: dict[str, np.ndarray], names: list[str]) -> list[dict[str, Any]]:
    keys = [pieces["pass"], pieces["stream"], pieces["reading"], pieces["shard"], pieces["record"]]
    end = pieces["token_start"] + pieces["length"]
    a, b = find_overlaps(keys, pieces["token_start"], end)
    # "first" is the earlier delivery in time: by generation, then step, then rank
    a_first = np.ones(len(a), bool)
    for name in ("rank", "step", "generation"):  # least significant first
        x, y = pieces[name][a], pieces[name][b]
        a_first = (x < y) | ((x == y) & a_first)
    earlier, later = np.where(a_first, a, b), np.where(a_first, b, a)
    order = np.lexsort([pieces["rank"][later], pieces["step"][later]])
    later, earlier = later[order], earlier[order]
    out = []
    for i, j in zip(later.tolist(), earlier.tolist()):
        lo = max(int(pieces["token_start"][i]), int(pieces["token_start"][j]))
        hi = min(int(end[i]), int(end[j]))
        out.append({
            "pass": int(pieces["pass"][i]), "stream": _name(names, pieces["stream"][i]),
            "reading": int(pieces["reading"][i]),
            "shard": int(pieces["shard"][i]), "record": int(pieces["record"][i]), "tokens": [lo, hi],
            "first": _where(pieces, j), "again": _where(pieces, i),
        })
    return out


def _where(pieces: dict[str, np.ndarray], i: int) -> dict[str, Any]:
    return {"step": int(pieces["step"][i]), "rank": int(pieces["rank"][i]),
            "generation": int(pieces["generation"][i]), "skipped": bool(pieces["skipped"][i]),
            "tokens": [int(pieces["token_start"][i]), int(pieces["token_start"][i] + pieces["length"][i])]}


def _name(names: list[str], stream: Any) -> str:
    s = int(stream)
    return names[s] if 0 <= s < len(names) else f"stream{s}"


def _skipped_steps(steps: dict[str, np.ndarray], pieces: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Runs of consecutive skipped steps, with the tokens they held on all ranks."""
    marked = np.unique(steps["step"][steps["skipped"]])
    if not len(marked):
        return []
    breaks = np.flatnonzero(np.diff(marked) != 1) + 1
    out = []
    for run in np.split(marked, breaks):
        a, b = int(run[0]), int(run[-1]) + 1
        inside = pieces["skipped"] & (pieces["step"] >= a) & (pieces["step"] < b)
        out.append({"steps": [a, b], "tokens": int(pieces["length"][inside].sum())})
    return out


def _passes(ledger: Ledger, pieces, manifests: dict[str, Any] | None, names: list[str]) -> list[dict[str, Any]]:
    steps = ledger.steps
    out = []
    for p in sorted(set(np.unique(steps["pass"]).tolist()) | set(ledger.passes)):
        plan = ledger.passes.get(p, {})
        mine = pieces["pass"] == p
        delivered = int(pieces["length"][mine & ~pieces["skipped"]].sum())
        skipped = int(pieces["length"][mine & pieces["skipped"]].sum())
        reached = _range(steps["step"][steps["pass"] == p])
        entry: dict[str, Any] = {"pass": p, "steps_reached": reached, "delivered_tokens": delivered,
                                 "skipped_tokens": skipped}
        if plan:
            last = plan["first_step"] + plan["steps"] - 1
            entry.update({
                "planned_steps": [plan["first_step"], last], "planned_tokens": plan["tokens"],
                "complete": reached is not None and reached[1] >= last and reached[0] <= plan["first_step"],
                "not_delivered_tokens": plan["tokens"] - delivered - skipped,
                "dropped_tokens": plan["dropped_tokens"], "drop_bound": plan["drop_bound"],
            })
        entry["partial_documents"] = _partial(pieces, mine, names)
        if manifests:
            entry["records_never_reached"] = _untouched(pieces, mine, names, manifests, repeated_streams(ledger))
        out.append(entry)
    return out


def _partial(pieces: dict[str, np.ndarray], mine: np.ndarray, names: list[str]) -> dict[str, Any]:
    """Documents whose last delivered piece says the document goes on."""
    idx = np.flatnonzero(mine)
    if not len(idx):
        return {"count": 0, "listed": []}
    key = [pieces[k][idx].astype(np.int64) for k in ("stream", "reading", "shard", "record")]
    end = pieces["token_start"][idx] + pieces["length"][idx]
    order = np.lexsort([end] + key[::-1])
    last = np.ones(len(order), bool)
    for k in key:
        ks = k[order]
        last[:-1] &= ks[1:] == ks[:-1]
    last = ~last  # the final piece of each document
    last[-1] = True
    final = idx[order[last]]
    cut = final[pieces["continues"][final]]
    listed = [{"stream": _name(names, pieces["stream"][i]), "reading": int(pieces["reading"][i]),
               "shard": int(pieces["shard"][i]),
               "record": int(pieces["record"][i]), "delivered_to": int(pieces["token_start"][i] + pieces["length"][i]),
               "step": int(pieces["step"][i]), "rank": int(pieces["rank"][i])} for i in cut.tolist()]
    return {"count": len(listed), "listed": listed}


def _untouched(pieces, mine, names, manifests, repeated) -> dict[str, Any]:
    """Per stream: non-empty records (empty ones are never delivered) no piece touched, in
    each whole reading of a repeated stream (a partial last reading reads only a part)."""
    out = {}
    for s, name in enumerate(names):
        manifest = manifests.get(name)
        if manifest is None:
            out[name] = {"unknown": "manifest not read"}
            continue
        whole = int(repeated[s][1]) if s in repeated else 1
        sel = mine & (pieces["stream"] == s) & (pieces["reading"] < whole)
        virtual = pieces["reading"][sel] * manifest.num_shards + pieces["shard"][sel]
        touched = np.unique(np.stack([virtual.astype(np.int64), pieces["record"][sel]], axis=1), axis=0)
        size = whole * manifest.num_shards
        per_shard = np.bincount(touched[:, 0], minlength=size) if len(touched) else np.zeros(size, np.int64)
        docs = np.tile(np.asarray(manifest.columns.get("num_docs", manifest.columns["num_records"]), np.int64), whole)
        missing = np.maximum(docs - per_shard[:size], 0)
        out[name] = {"records": int(np.sum(docs)), "touched": int(len(touched)), "never_reached": int(missing.sum()),
                     "shards_with_untouched": int((missing > 0).sum()),
                     "counts": "non-empty records" if "num_docs" in manifest.columns else "records (empty ones included)"}
        if s in repeated:
            out[name]["whole_readings"] = whole
    return out


# -- diff --------------------------------------------------------------------------------------
DIFF_COLUMNS = ("step", "rank", "start", "length", "stream", "shard", "record", "token_start", "continues", "skipped")


def diff(a: Ledger, b: Ledger) -> dict[str, Any]:
    """The first (step, rank, piece) where the two data orders differ, over the steps both
    ledgers cover; streams are compared by name."""
    last = min(_top(a), _top(b))
    vocabulary = {n: i for i, n in enumerate(sorted(set(a.stream_names) | set(b.stream_names)))}
    cols_a, cols_b = _ordered(a, last, vocabulary), _ordered(b, last, vocabulary)
    n = min(len(cols_a["step"]), len(cols_b["step"]))
    same = np.ones(n, bool)
    for c in DIFF_COLUMNS:
        same &= cols_a[c][:n] == cols_b[c][:n]
    bad = np.flatnonzero(~same)
    steps_a = np.unique(a.steps["step"][a.steps["step"] <= last])
    out: dict[str, Any] = {"common_steps": int(len(steps_a)), "last_common_step": int(last),
                           "steps": [_range(a.steps["step"]), _range(b.steps["step"])]}
    if len(bad) == 0 and len(cols_a["step"]) == len(cols_b["step"]):
        out["identical"] = True
        return out
    i = int(bad[0]) if len(bad) else n
    at = min((_key(cols_a, i), _key(cols_b, i)))
    out.update({"identical": False, "step": at[0], "rank": at[1],
                "a": show(a, at[0], ranks=[at[1]])["ranks"], "b": show(b, at[0], ranks=[at[1]])["ranks"]})
    out["piece"] = i - int(np.searchsorted(_pair(cols_a), at[0] * 2**20 + at[1]))
    return out


def _top(ledger: Ledger) -> int:
    return int(ledger.steps["step"].max()) if len(ledger.steps["step"]) else -1


def _ordered(ledger: Ledger, last: int, vocabulary: dict[str, int]) -> dict[str, np.ndarray]:
    """The pieces up to step ``last`` sorted by (step, rank, start); streams as indexes into
    ``vocabulary`` (names shared by both ledgers)."""
    p = ledger.pieces
    keep = p["step"] <= last
    cols = {c: p[c][keep].astype(np.int64) for c in DIFF_COLUMNS if c != "stream"}
    names = ledger.stream_names
    code = np.array([vocabulary.get(n, -1) for n in names] + [-1], np.int64)
    stream = p["stream"][keep].astype(np.int64)
    cols["stream"] = code[np.where((stream >= 0) & (stream < len(names)), stream, len(names))]
    order = np.lexsort([cols["start"], cols["rank"], cols["step"]])
    return {c: v[order] for c, v in cols.items()}


def _pair(cols: dict[str, np.ndarray]) -> np.ndarray:
    return cols["step"] * 2**20 + cols["rank"]


def _key(cols: dict[str, np.ndarray], i: int) -> tuple[int, int]:
    if i >= len(cols["step"]):
        return (2**62, 0)
    return int(cols["step"][i]), int(cols["rank"][i])


# -- show --------------------------------------------------------------------------------------
def show(ledger: Ledger, step: int, ranks: list[int] | None = None) -> dict[str, Any]:
    """The pieces of ``step`` per rank and row (a piece over a row boundary is cut there)."""
    steps, pieces, names = ledger.steps, ledger.pieces, ledger.stream_names
    at = steps["step"] == step
    out: dict[str, Any] = {"step": int(step), "ranks": []}
    if at.any():
        out["pass"] = int(steps["pass"][at][0])
        out["generation"] = int(steps["generation"][at][0])
        out["skipped"] = bool(steps["skipped"][at].any())
    rows = StepSchedule.build("batch_size", ledger.meta.get("batch_size", 1)).at(step)  # an int, or by step
    seq_len = ledger.seq_len_at(step)
    repeated = repeated_streams(ledger)
    for r in sorted(set(steps["rank"][at].tolist())):
        if ranks is not None and r not in ranks:
            continue
        sel = (pieces["step"] == step) & (pieces["rank"] == r)
        batch = _as_batch(pieces, sel, rows, seq_len)
        cut = split_at_rows(batch)
        out["ranks"].append({"rank": r, "rows": [
            {"row": int(cut["row"][i]), "col": int(cut["col"][i]), "stream": _name(names, cut["stream"][i]),
             **_shard_of(repeated, int(cut["stream"][i]), int(cut["shard"][i])), "record": int(cut["record"][i]),
             "tokens": [int(cut["token_start"][i]), int(cut["token_start"][i] + cut["length"][i])],
             "continues": bool(cut["continues"][i])}
            for i in range(len(cut["row"]))]})
    return out


def _shard_of(repeated: dict[int, tuple[int, float]], stream: int, shard: int) -> dict[str, int]:
    """A piece's shard, with its reading where the stream is read more than once."""
    if stream not in repeated:
        return {"shard": shard}
    reading, shard = divmod(shard, repeated[stream][0])
    return {"reading": reading, "shard": shard}


def _as_batch(pieces: dict[str, np.ndarray], sel: np.ndarray, rows: int, seq_len: int) -> RowBatch:
    order = np.argsort(pieces["start"][sel], kind="stable")
    col = {k: pieces[k][sel][order] for k in ("start", "length", "stream", "shard", "record", "token_start", "continues")}
    tokens = np.zeros((rows, seq_len + 1), np.uint8)  # only the shape is read
    return RowBatch(tokens, np.zeros(rows, bool), col["start"], col["length"], col["stream"], col["shard"],
                    col["record"], col["token_start"], col["continues"])
