"""Reading a ledger back: every chunk and header, with the rollback of each restart applied
(``store.py`` says what the generations mean)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import LedgerError
from ..planning.steps import StepSchedule
from ..storage.open import open_url
from .layout import GENERATIONS, PIECE_COLUMNS, STEP_COLUMNS, list_ledger

@dataclass
class Ledger:
    """A ledger as read: the effective steps and pieces (after rollback) as numpy columns.

    ``steps``: step, pass, skipped, num_pieces, rank, generation (one entry per rank and step).
    ``pieces``: the ``PIECE_COLUMNS`` plus step, pass, skipped, rank, generation of their step.
    ``generations``: every header, ordered; ``restarts``: the generations grouped by restart
    (``group_restarts``). ``rolled_back``: the steps (one per rank) a later restart voided.
    ``damaged``: records skipped as damaged, with the pass and rank that met them.
    ``passes``: pass -> plan summary. ``problems``: inconsistencies found while reading.
    ``uncommitted``: the steps of participants that record commits (torchft) past their last
    commit: handed out, never trained (void); a step its quorum committed counts as trained
    (``_committed_by_quorum``). ``membership``: the live-membership history
    ``[[step, participants], ...]`` the participants last recorded (None without one).
    """

    steps: dict[str, np.ndarray]
    pieces: dict[str, np.ndarray]
    generations: list[dict[str, Any]]
    restarts: list[dict[str, Any]]
    rolled_back: dict[str, np.ndarray]
    damaged: list[dict[str, Any]] = field(default_factory=list)
    passes: dict[int, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    uncommitted: dict[str, np.ndarray] = field(default_factory=dict)
    membership: list[list[int]] | None = None

    @property
    def meta(self) -> dict[str, Any]:
        """The meta of the latest generation (``{}`` for an empty ledger)."""
        return self.generations[-1]["meta"] if self.generations else {}

    @property
    def stream_names(self) -> list[str]:
        return [s["name"] for s in self.meta.get("streams", [])]

    @property
    def seq_len(self) -> int:
        value = self.meta.get("seq_len", 0)
        return int(value) if not isinstance(value, list) else max(v for _, v in value)

    def seq_len_at(self, step: int) -> int:
        """The row length at ``step`` (a seq_len schedule is kept as ``[[step, seq_len], ...]``)."""
        value = self.meta.get("seq_len", 0)
        return int(value) if not isinstance(value, list) else StepSchedule.build("seq_len", value).at(step)


def read_ledger(url: str, storage_options: dict[str, Any] | None = None) -> Ledger:
    """Every chunk and header under ``url``, with the rollback of each restart applied."""
    fs, root = open_url(str(url), storage_options)
    header_paths, chunks = list_ledger(fs, root)
    headers = {(g, r): json.loads(blob) for (g, r, _), blob in
               zip(header_paths, _read_many(fs, [p for _, _, p in header_paths]))}
    if not headers and not chunks:
        if not fs.exists(root):
            raise LedgerError(f"{url}: no ledger here (the path does not exist)")
        raise LedgerError(f"{url}: no ledger here (no {GENERATIONS}/gen-*/rank*.json or rank*/gen-*.npz)")
    problems: list[str] = []
    blobs = _read_many(fs, [c[3] for c in chunks])
    step_parts, piece_parts, damaged, passes = [], [], [], {}
    committed: dict[tuple[int, int], int] = {}  # (generation, rank) -> its last commit
    history, history_key = None, None
    for (gen, rank, seq, path), blob in zip(chunks, blobs):
        if (gen, rank) not in headers:
            problems.append(f"{path}: chunk of generation {gen} on rank {rank} without its header")
        steps, pieces, info = _decode_chunk(path, blob)
        if (info.get("generation"), info.get("rank")) != (gen, rank):
            problems.append(f"{path}: the chunk says generation {info.get('generation')} of rank "
                            f"{info.get('rank')}; its name says generation {gen} of rank {rank}")
        for column in (steps, pieces):
            column["rank"] = np.full(len(column["step"]), rank, np.int32)
            column["generation"] = np.full(len(column["step"]), gen, np.int32)
        step_parts.append(steps)
        piece_parts.append(pieces)
        last_pass = int(steps["pass"][-1]) if len(steps["pass"]) else None
        damaged += [{**d, "pass": last_pass, "rank": rank} for d in info.get("damaged", [])]
        for k, v in info.get("passes", {}).items():
            passes.setdefault(int(k), []).append({**v, "generation": gen, "rank": rank})
        if info.get("committed") is not None:
            committed[gen, rank] = max(committed.get((gen, rank), -1), int(info["committed"]))
        if info.get("membership"):  # the history reaching furthest, then the latest written
            key = (info["membership"][-1][0], gen, seq)
            if history_key is None or key > history_key:
                history, history_key = info["membership"], key
    piece_columns = {**PIECE_COLUMNS, **{k: v for k, v in STEP_COLUMNS.items() if k != "num_pieces"}}
    steps, pieces = _concat(step_parts, STEP_COLUMNS), _concat(piece_parts, piece_columns)
    generations = sorted(headers.values(), key=lambda h: (h["generation"], h["time"], h["rank"]))
    restarts = group_restarts(generations)
    commits = {(int(h["generation"]), int(h["rank"])) for h in generations if h.get("commits")}
    live_steps, done_steps = _effective(steps, restarts, commits, committed)
    live_pieces, done_pieces = _effective(pieces, restarts, commits, committed)
    if history:
        quorum = _committed_by_quorum(steps, live_steps, done_steps, history)
        done_steps |= quorum[0]
        done_pieces |= np.isin(_keys(pieces), quorum[1])
    keep_steps, keep_pieces = live_steps & done_steps, live_pieces & done_pieces
    return Ledger(
        steps={k: v[keep_steps] for k, v in steps.items()},
        pieces={k: v[keep_pieces] for k, v in pieces.items()},
        generations=generations, restarts=restarts, rolled_back={k: v[~live_steps] for k, v in steps.items()},
        damaged=_unique(damaged),
        passes={p: _full_plan(_standing(items, restarts)) for p, items in sorted(passes.items())},
        problems=problems, uncommitted={k: v[live_steps & ~done_steps] for k, v in steps.items()},
        membership=history,
    )


def _read_many(fs, paths: list[str]) -> list[bytes]:
    if not paths:
        return []
    out = fs.cat(paths)  # one batched call: concurrent on object stores
    return [out[p] if p in out else out[fs._strip_protocol(p)] for p in paths]


def _decode_chunk(path: str, blob: bytes) -> tuple[dict, dict, dict]:
    try:
        with np.load(io.BytesIO(blob)) as z:
            arrays = {k: z[k] for k in z.files}
        info = json.loads(arrays["info"].tobytes())
        steps = {name: np.ascontiguousarray(arrays["steps"][name], dtype) for name, dtype in STEP_COLUMNS.items()}
        pieces = {name: np.ascontiguousarray(arrays["pieces"][name], dtype) for name, dtype in PIECE_COLUMNS.items()}
    except (OSError, ValueError, KeyError) as exc:
        raise LedgerError(f"{path}: not a readable ledger chunk ({exc})") from exc
    counts = steps["num_pieces"]
    if int(counts.sum()) != len(pieces["start"]):
        raise LedgerError(f"{path}: {int(counts.sum())} pieces announced by its steps, {len(pieces['start'])} stored")
    for name in ("step", "pass", "skipped"):
        pieces[name] = np.repeat(steps[name], counts)
    return steps, pieces, info


def _concat(parts: list[dict], columns: dict) -> dict[str, np.ndarray]:
    columns = {**columns, "rank": np.int32, "generation": np.int32}
    if not parts:
        return {n: np.zeros(0, dtype) for n, dtype in columns.items()}
    return {n: np.concatenate([p[n] for p in parts]) for n in columns}


def group_restarts(generations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The restarts of the job, in order: each folds the headers of one or more generations
    (``generations``: their numbers, ``ranks``, ``resumed_at_step``, ``mode``, ``world_size``,
    ``time``). Adjacent generations that resumed at the same step on disjoint ranks are one
    restart whose ranks raced for the number (see the module docstring). ``scope``: "job"
    (a restart of the whole job: it voids every rank's later steps) or "participant" (one
    replica group that restarted, or a batch put back: it voids that participant's only)."""
    out: list[dict[str, Any]] = []
    for mine in _by_number(generations):
        number = int(mine[0]["generation"])
        ranks = {int(h["rank"]) for h in mine}
        step = min(int(h["resumed_at_step"]) for h in mine)
        scope = "participant" if all(h.get("scope") == "participant" for h in mine) else "job"
        last = out[-1] if out else None
        if last is not None and last["resumed_at_step"] == step and not ranks & set(last["ranks"]) and (
                last["scope"] == scope):
            last["generations"].append(number)
            last["ranks"] = sorted(set(last["ranks"]) | ranks)
            continue
        h = mine[0]
        out.append({"generations": [number], "ranks": sorted(ranks), "resumed_at_step": step, "mode": h["mode"],
                    "world_size": int(h["world_size"]), "time": min(x["time"] for x in mine), "scope": scope})
    return out


def _by_number(generations: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The headers of each generation number; participants' headers of one number that resumed
    at different steps apart (participants of different processes race for numbers, and the
    restart of one is not another's)."""
    out = []
    for number in sorted({int(h["generation"]) for h in generations}):
        mine = [h for h in generations if int(h["generation"]) == number]
        if all(h.get("scope") == "participant" for h in mine):
            steps = sorted({h["resumed_at_step"] for h in mine})
            out += [[h for h in mine if h["resumed_at_step"] == s] for s in steps]
        else:
            out.append(mine)
    return out


def restart_index(restarts: list[dict[str, Any]], generation: int, rank: int | None = None) -> int | None:
    """The restart holding ``generation`` (on ``rank``, where participants share a number)."""
    hits = [i for i, r in enumerate(restarts) if generation in r["generations"]]
    mine = [i for i in hits if rank in restarts[i]["ranks"]]
    return (mine or hits or [None])[0]


def rollback_cutoffs(restarts: list[dict[str, Any]], numbers, rank: int | None = None) -> dict[int, float]:
    """generation -> the first step voided in it (on ``rank``; None: a rank no participant
    restart names): the smallest step any later restart of the job, or of that participant,
    resumed at (infinity when none did). ``numbers``: the generations to answer for; one
    without a header (a lost header) is voided by the restarts numbered after it."""
    out = {}
    for g in numbers:
        g = int(g)
        index = restart_index(restarts, g, rank)
        if index is not None:
            later = restarts[index + 1:]
        else:
            later = [r for r in restarts if min(r["generations"]) > g]
        out[g] = min((r["resumed_at_step"] for r in later if r.get("scope", "job") == "job" or rank in r["ranks"]),
                     default=float("inf"))
    return out


def _effective(columns: dict[str, np.ndarray], restarts: list[dict[str, Any]], commits: set,
               committed: dict[tuple[int, int], int]) -> tuple[np.ndarray, np.ndarray]:
    """Masks of the records no later restart rolled back, and of those committed (every
    record of a generation that does not record commits)."""
    pairs = np.stack([columns["generation"].astype(np.int64), columns["rank"].astype(np.int64)], axis=1)
    if not len(pairs):
        return np.zeros(0, bool), np.zeros(0, bool)
    uniq, inverse = np.unique(pairs, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    limits, done = np.empty(len(uniq)), np.empty(len(uniq))
    for i, (g, r) in enumerate(uniq.tolist()):
        limits[i] = rollback_cutoffs(restarts, [g], r)[g]
        done[i] = committed.get((g, r), -1) if (g, r) in commits else np.inf
    step = columns["step"]
    return step < limits[inverse], step <= done[inverse]


def _keys(columns: dict[str, np.ndarray]) -> np.ndarray:
    """One int64 key per record: its (generation, rank, step)."""
    return ((columns["generation"].astype(np.int64) << 48) | (columns["rank"].astype(np.int64) << 32)
            | columns["step"].astype(np.int64))


def _committed_by_quorum(steps: dict[str, np.ndarray], live: np.ndarray, done: np.ndarray,
                         history: list) -> tuple[np.ndarray, np.ndarray]:
    """Steps a participant handed out and never committed that its quorum did commit: under
    torchft a group whose gradients were reduced at a step, killed before its own commit, was
    trained at that step by the groups that committed it. Counted where the membership history
    has exactly as many participants live at the step as committed it plus those left
    uncommitted (a step redone on a smaller membership after a failed commit has the redo's
    count live, and the failed attempt's records then stay void). Returns the step mask and
    the (generation, rank, step) keys of those steps."""
    pending = live & ~done
    if not pending.any():
        return np.zeros(len(live), bool), np.zeros(0, np.int64)
    step = steps["step"].astype(np.int64)
    starts = np.array([s for s, _ in history], np.int64)
    counts = np.array([n for _, n in history], np.int64)
    at = np.searchsorted(starts, step, side="right") - 1
    live_count = np.where(at >= 0, counts[np.maximum(at, 0)], 0)
    committed_at = np.unique(np.stack([step[live & done], steps["rank"][live & done].astype(np.int64)], axis=1), axis=0)
    pending_at = np.unique(np.stack([step[pending], steps["rank"][pending].astype(np.int64)], axis=1), axis=0)
    got = dict(zip(*np.unique(committed_at[:, 0], return_counts=True))) if len(committed_at) else {}
    waiting = dict(zip(*np.unique(pending_at[:, 0], return_counts=True)))
    ok = np.array([got.get(s, 0) > 0 and got.get(s, 0) + waiting.get(s, 0) == n
                   for s, n in zip(step.tolist(), live_count.tolist())], bool) & pending
    return ok, _keys(steps)[ok]


def _standing(items: list[dict], restarts: list[dict[str, Any]]) -> list[dict]:
    """The plan summaries no later restart voided (a re-plan made at or past its generation's
    cutoff belongs to a run that was rolled back)."""
    return [i for i in items if not i.get("remaining") or i.get("first_step", 0) < rollback_cutoffs(
        restarts, [i["generation"]], i.get("rank"))[i["generation"]]]


def _unique(items: list[dict]) -> list[dict]:
    seen, out = set(), []
    for item in items:
        key = json.dumps({k: v for k, v in item.items() if k != "rank"}, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


def _full_plan(items: list[dict]) -> dict:
    """A pass's plan summary: the latest one made from the whole pass, extended by the plans
    of what later resumes (elastic or statistical) left of it: the pass ends where the last of
    them ends, each re-plan adds its own drop bound, and the pass drops what the last one drops."""
    whole = [i for i in items if not i.get("remaining")]
    base = dict((whole or items)[-1])
    later, seen = [], set()
    # by first step (a re-plan at a step replaces one made there before), each re-plan once
    # (every participant of a live membership records the segments it follows)
    for i in sorted(items, key=lambda i: i["first_step"]):
        key = tuple(i.get(k) for k in ("first_step", "steps", "tokens", "dropped_tokens", "drop_bound", "world_size"))
        if i.get("remaining") and i["first_step"] >= base["first_step"] and key not in seen:
            seen.add(key)
            later.append(i)
    if whole and later:
        last = later[-1]
        base["steps"] = last["first_step"] + last["steps"] - base["first_step"]
        base["drop_bound"] = base["drop_bound"] + sum(i["drop_bound"] for i in later)
        # the last re-plan holds all the work its predecessors left, their surplus included:
        # what it drops is what the pass drops
        base["dropped_tokens"] = last["dropped_tokens"]
        base["replans"] = len(later)
    return base
