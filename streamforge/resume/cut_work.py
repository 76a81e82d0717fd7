"""The work a token-cut pass leaves (``planning/token_cuts.py``), for an elastic resume.

A saved worker's ranges may begin and end inside documents: its first record's head and its
last record's tail belong to its neighbours. ``work_left`` sees the worker's records through
its ``CutSource``; here each cut record still unread leaves the ranges and becomes a window's
rest of its own (one record, ``trims`` naming the worker's piece of it), so the ranges the
new topology cuts hold whole records only, and every piece is read through its own trims
(``ShuffleBuffer.unit_source``), by whichever new worker it is dealt to. A window's rest
that holds cut records carries their trims the same way.
"""

from __future__ import annotations

from ..stages.cut_source import CutSource


def view_trims(source) -> dict:
    """The ``(shard, record) -> (lo, hi)`` trims a reader's source applies (none: {})."""
    return dict(source.trims) if isinstance(source, CutSource) else {}


def unit_trims(trims: dict, ranges) -> list[list[int]]:
    """``trims`` of the records inside ``ranges``, as a window's rest saves them."""
    return [[s, r, lo, hi] for (s, r), (lo, hi) in sorted(trims.items())
            if any(int(a) <= r < int(b) and int(x) == s for x, a, b in ranges)]


def split_cut_records(ranges, source, eos: bool) -> tuple[list, list[dict]]:
    """``ranges`` without their cut records, and a window's rest for each of those."""
    trims = view_trims(source)
    if not trims:
        return [list(r) for r in ranges], []
    out, units = [], []
    for s, a, b in ranges:
        s, a, b = int(s), int(a), int(b)
        for r in sorted(r for (x, r) in trims if x == s and a <= r < b):
            if r > a:
                out.append([s, a, r])
            lo, hi = trims[(s, r)]
            size = int(source.index(s).records["num_tokens"][r])  # the piece's, through the trims
            units.append({"ranges": [[s, r, r + 1]], "key": 0, "pos": 0, "offset": 0,
                          "tokens": size + (1 if eos and hi == 0 and size else 0), "docs": 1 if size else 0,
                          "trims": [[s, r, lo, hi]]})
            a = r + 1
        if b > a:
            out.append([s, a, b])
    return out, [u for u in units if u["docs"]]


def use_saved_cuts(dataset, state: dict) -> None:
    """Let the dataset's planner cut the saved job's passes as that job did: at token positions
    for its topology and batch size where its config says ``cuts="tokens"``."""
    from ..planning.token_cuts import CutSpec
    from .state import config_value

    config = state.get("config") or {}
    if config_value(config, "cuts") != "tokens":
        return
    batch = state.get("batch_size")
    seq_len = config.get("seq_len", dataset.config.seq_len)
    if not isinstance(batch, int) or not isinstance(seq_len, int):
        return  # token cuts refuse schedules: such a state was not saved with them
    spec = CutSpec(int(state["world_size"]), int(state["workers_per_rank"]), batch, seq_len,
                   finite=not config.get("infinite", False))
    dataset.planner.set_token_cuts(spec, dataset.eos_appended)


def use_loader_cuts(dataset, loader) -> None:
    """Let the planner cut passes for this loader's topology and batch size again (after a
    resume that read the saved job's cuts)."""
    if dataset.config.cuts == "tokens" and not dataset.evaluation:
        from ..planning.token_cuts import cut_spec

        dataset.planner.set_token_cuts(cut_spec(dataset, loader.num_logical, loader.batch_sizes), dataset.eos_appended)


def pass_unassigned(dataset, state: dict) -> list[int] | None:
    """Per stream, the tokens of the saved pass its plan gave no worker (token cuts): carried
    into the work left, so the re-planned rest of the pass still counts them as dropped."""
    n = int(state["world_size"]) * int(state["workers_per_rank"])
    return dataset.planner.cut_unassigned(int(state["pass"]), n)


def rest_unassigned(dataset, work: dict, assigned, work_tokens: list[int]) -> list[int] | None:
    """Per stream, the tokens of the saved pass no worker of the re-plan reads: the saved
    plan's rest, and under token cuts what the re-plan's steps cannot take (``work_tokens``:
    the work's tokens per stream)."""
    carried = work.get("unassigned")
    if getattr(dataset.config, "cuts", "records") != "tokens":
        return carried
    left = [int(w) - int(a[2].sum()) for w, a in zip(work_tokens, assigned)]
    return [x + int(c) for x, c in zip(left, carried or [0] * len(left))]
