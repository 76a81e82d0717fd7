"""Evaluation passes: every held-out token once, in rows that do not depend on the topology.

The rows of an evaluation pass are a pure function of the corpus, ``seq_len`` and the packing
mode. Each stream's documents are laid out in stored order (shard 0, 1, ...; records in
order), with EOS appended where the training pipeline appends it, and cut into rows:

  concat  every ``seq_len`` tokens: a document runs over row boundaries and the label of a
          row's last token is the stream's next token; the stream's last row is padded.
  pad     each document on rows of its own, split every ``seq_len`` tokens, the rest padded.

The global row sequence is stream 0's rows, then stream 1's, and so on; ``eval_tokens``
keeps its first rows up to that many tokens. Only then are rows dealt to the job
(``deal_rows``): ``steps = ceil(rows / (R * B))``, and global worker ``g`` gets a contiguous
run of rows, no longer than its batches hold, the runs balanced and laid end to end in ``g``
order. What a worker's batches have left over are padding rows. So the multiset of rows over
the job, and any loss summed over them, is the same for every (R, W, B), and every rank has
``steps`` full batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from .batch import RowBatch, padding_rows
from ..planning.plan import PassClock
from ..errors import ConfigError, ResumeMismatchError, ShardCorruptError
from ..stages.base import check_state

_CHUNK_TOKENS = 1 << 18  # tokens read per request to a shard's records (whole records)


# -- the rows of a stream (pure) ------------------------------------------------------------

def doc_rows(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Rows each document takes in pad packing (0 for an empty record)."""
    return -(-np.asarray(lengths, np.int64) // seq_len)


def rows_for_tokens(tokens: int, seq_len: int) -> int:
    """Rows of a concat stream of ``tokens`` tokens."""
    return -(-int(tokens) // seq_len)


def pad_rows_for_tokens(lengths: np.ndarray, tokens: int, seq_len: int) -> int:
    """Pad packing: the fewest leading rows of documents ``lengths`` holding ``tokens`` tokens."""
    ends = np.cumsum(lengths)
    d = int(np.searchsorted(ends, tokens, side="left"))
    if d >= len(lengths):
        return int(doc_rows(lengths, seq_len).sum())
    before = int(ends[d] - lengths[d])
    return int(doc_rows(lengths[:d], seq_len).sum()) + rows_for_tokens(tokens - before, seq_len)


def pad_tokens_in_rows(lengths: np.ndarray, rows: int, seq_len: int) -> int:
    """Pad packing: tokens in the first ``rows`` rows of documents ``lengths``."""
    per_doc = np.concatenate([[0], np.cumsum(doc_rows(lengths, seq_len))])
    d = int(np.searchsorted(per_doc, rows, side="right")) - 1
    if d >= len(lengths):
        return int(np.sum(lengths))
    return int(np.sum(lengths[:d])) + min(int(lengths[d]), (rows - int(per_doc[d])) * seq_len)


def deal_rows(num_rows: int, *, world_size: int, workers_per_rank: int, batch_size: int) -> tuple[int, list[list[int]]]:
    """(steps, [start, stop) of global rows per global worker).

    Worker ``w`` of every rank builds ``ceil((steps - w) / W)`` batches (the job clock,
    ``plan.PassPlan.batches_of``), so it holds that many times ``batch_size`` rows; runs are
    filled as evenly as those capacities allow and laid out in global-worker order.
    """
    steps = -(-num_rows // (world_size * batch_size))
    caps = []
    for g in range(world_size * workers_per_rank):
        w = g % workers_per_rank
        caps.append(batch_size * (-(-(steps - w) // workers_per_rank) if steps > w else 0))
    share = [0] * len(caps)
    left = num_rows
    for i, g in enumerate(sorted(range(len(caps)), key=caps.__getitem__)):
        share[g] = min(caps[g], -(-left // (len(caps) - i)))
        left -= share[g]
    assert left == 0, (num_rows, caps)
    runs, start = [], 0
    for n in share:
        runs.append([start, start + n])
        start += n
    return steps, runs


@dataclass
class EvalPlan(PassClock):
    """An evaluation pass: the row layout of each stream, and each global worker's rows.

    Plain data (``to_dict``). ``shard_tokens[s]`` are stream ``s``'s tokens per shard (EOS
    appended included); ``shard_rows[s]`` its rows per shard (pad packing only; concat rows
    follow from the tokens); ``stream_rows[s]`` and ``stream_tokens[s]`` what the pass keeps
    of the stream (all of it, unless ``eval_tokens`` stops earlier). ``runs[g]`` is global
    worker ``g``'s ``[start, stop)`` in the global row sequence.
    """

    world_size: int
    workers_per_rank: int
    batch_size: int
    seq_len: int
    packing: str
    streams: list[str]
    shard_tokens: list[list[int]]
    shard_rows: list[list[int]] | None
    stream_rows: list[int]
    stream_tokens: list[int]
    runs: list[list[int]]
    steps: int
    pass_idx: int = 0
    first_step: int = 0

    @property
    def num_rows(self) -> int:
        return sum(self.stream_rows)

    @property
    def num_tokens(self) -> int:
        return sum(self.stream_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EvalPlan":
        return cls(**data)


def build_eval_plan(
    planner, *, eos_appended: Sequence[bool], world_size: int, workers_per_rank: int, batch_size: int,
    seq_len: int, packing: str, eval_tokens: int | None = None,
) -> EvalPlan:
    """The evaluation plan: reads no record index in concat packing when the manifests have
    per-shard document counts; pad packing reads every shard's index (rows per document)."""
    shard_tokens, shard_rows, lengths = [], [], []
    for s, m in enumerate(planner.manifests):
        n = m.num_shards
        if packing == "pad":
            per_shard = planner.record_lengths(s, range(n), eos=eos_appended[s])
            lengths.append(per_shard)
            shard_tokens.append([int(x.sum()) for x in per_shard])
            shard_rows.append([int(doc_rows(x, seq_len).sum()) for x in per_shard])
        else:
            planner.prefetch_counts(s, [(k, 0, int(m.columns["num_records"][k])) for k in range(n)])
            counts = [planner.counts(s, k, 0, int(m.columns["num_records"][k])) for k in range(n)]
            shard_tokens.append([t + (d if eos_appended[s] else 0) for t, d in counts])
    stream_rows, stream_tokens = [], []
    budget = None if eval_tokens is None else int(eval_tokens)
    for s, toks in enumerate(shard_tokens):
        total = sum(toks)
        keep = total if budget is None else min(total, budget)
        if packing == "pad":
            rows = sum(shard_rows[s]) if keep == total else pad_rows_for_tokens(
                np.concatenate(lengths[s]) if lengths[s] else np.zeros(0, np.int64), keep, seq_len)
            kept = keep if keep == total else pad_tokens_in_rows(np.concatenate(lengths[s]), rows, seq_len)
        else:
            rows = rows_for_tokens(keep, seq_len)
            kept = min(total, rows * seq_len)  # eval_tokens: whole rows
        stream_rows.append(rows)
        stream_tokens.append(kept)
        if budget is not None:
            budget -= keep
    steps, runs = deal_rows(sum(stream_rows), world_size=world_size, workers_per_rank=workers_per_rank,
                            batch_size=batch_size)
    return EvalPlan(
        world_size=world_size, workers_per_rank=workers_per_rank, batch_size=batch_size, seq_len=seq_len,
        packing=packing, streams=list(planner.names), shard_tokens=shard_tokens,
        shard_rows=shard_rows if packing == "pad" else None, stream_rows=stream_rows,
        stream_tokens=stream_tokens, runs=runs, steps=steps,
    )


# -- reading rows ----------------------------------------------------------------------------

class _DocReader:
    """One stream's tokens in stored order from a token offset, EOS appended, read in chunks
    of whole records through the stream's ``ShardSource``."""

    def __init__(self, source, stream: int, shard_tokens: Sequence[int], eos_id: int | None) -> None:
        self.source = source
        self.stream = stream
        self.eos_id = eos_id
        self.prefix = np.concatenate([[0], np.cumsum(np.asarray(shard_tokens, np.int64))])
        self.shard = 0
        self.next_record = 0  # first record of the shard not yet in the buffer
        self.buf = np.zeros(0, source.dtype)
        self.offsets = np.zeros(1, np.int64)  # buffer offset of each buffered document
        self.records = np.zeros(0, np.int64)
        self.pos = 0
        self._lengths_of: tuple[int, np.ndarray] = (-1, self.offsets)

    def _lengths(self, shard: int) -> np.ndarray:
        """Tokens of each record of ``shard`` as laid out here (EOS included)."""
        if self._lengths_of[0] != shard:
            lengths = self.source.index(shard).records["num_tokens"].astype(np.int64)
            self._lengths_of = (shard, lengths + (lengths > 0) if self.eos_id is not None else lengths)
        return self._lengths_of[1]

    def seek(self, token: int, stop_token: int) -> None:
        """Start at the stream's ``token``; announce the records up to ``stop_token`` for
        prefetch."""
        first = self._locate(token)
        last = self._locate(max(stop_token - 1, token))
        self.shard, record, within = first
        ranges = []
        for shard in range(first[0], last[0] + 1):
            a = record if shard == first[0] else 0
            b = last[1] + 1 if shard == last[0] else len(self.source.index(shard).records)
            if b > a:
                ranges.append((shard, a, b))
        self.source.plan_reads(ranges)
        self._load(self.shard, record)
        self.pos = within

    def _locate(self, token: int) -> tuple[int, int, int]:
        """(shard, record, offset in the record) of a stream token offset."""
        shard = int(np.searchsorted(self.prefix, token, side="right")) - 1
        shard = min(shard, len(self.prefix) - 2)
        ends = np.cumsum(self._lengths(shard))
        local = token - int(self.prefix[shard])
        record = int(np.searchsorted(ends, local, side="right"))
        if record >= len(ends):
            return shard, max(len(ends) - 1, 0), 0
        return shard, record, local - int(ends[record - 1] if record else 0)

    def _load(self, shard: int, record: int) -> bool:
        """Buffer the next chunk of records from (shard, record); False at the stream's end."""
        while shard < len(self.prefix) - 1:
            lengths = self._lengths(shard)
            if record < len(lengths):
                ends = np.cumsum(lengths[record:])
                stop = record + int(np.searchsorted(ends, _CHUNK_TOKENS, side="left")) + 1
                stop = min(stop, len(lengths))
                self._fill(shard, record, stop, lengths[record:stop])
                self.shard, self.next_record = shard, stop
                return True
            shard, record = shard + 1, 0
        self.shard, self.next_record = shard, 0
        self.buf = self.buf[:0]
        self.offsets = np.zeros(1, np.int64)
        self.records = np.zeros(0, np.int64)
        self.pos = 0
        return False

    def _fill(self, shard: int, start: int, stop: int, lengths: np.ndarray) -> None:
        batch = self.source.read(shard, start, stop)
        if len(batch.record) != stop - start:
            raise ShardCorruptError(
                f"{self.source.where(shard, None, (start, stop))}: damaged records cannot be left out of an "
                "evaluation pass (its rows would shift); repair the shard or evaluate without it"
            )
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        if self.eos_id is None:
            self.buf = batch.tokens
        elif batch.views is not None:  # one copy: each document's tokens, then EOS
            eos = np.array([self.eos_id], self.source.dtype)
            parts = [p for view in batch.views for p in ((view, eos) if len(view) else ())]
            self.buf = np.concatenate(parts) if parts else np.zeros(0, self.source.dtype)
        else:
            tokens, raw = batch.tokens, np.diff(batch.offsets)
            buf = np.full(int(self.offsets[-1]), self.eos_id, tokens.dtype)
            buf[np.arange(len(tokens)) + np.repeat(self.offsets[:-1] - batch.offsets[:-1], raw)] = tokens
            self.buf = buf
        self.records = np.arange(start, stop, dtype=np.int64)
        self.pos = 0

    def _ready(self) -> bool:
        while self.pos >= len(self.buf):
            if not self._load(self.shard, self.next_record):
                return False
        return True

    def peek(self) -> int | None:
        return int(self.buf[self.pos]) if self._ready() else None

    def doc_left(self) -> int:
        """Tokens left in the current document (0 at the stream's end)."""
        if not self._ready():
            return 0
        d = int(np.searchsorted(self.offsets, self.pos, side="right")) - 1
        return int(self.offsets[d + 1]) - self.pos

    def take(self, n: int, out: np.ndarray, pieces: list, base: int) -> int:
        """Copy up to ``n`` tokens into ``out``; append their document pieces (arrays: start
        in the batch, from ``base``; length, shard, record, token_start, continues). Returns
        the count."""
        got = 0
        while got < n and self._ready():
            k = min(n - got, len(self.buf) - self.pos)
            lo, hi = self.pos, self.pos + k
            out[got : got + k] = self.buf[lo:hi]
            offs = self.offsets
            d0 = int(np.searchsorted(offs, lo, side="right")) - 1
            d1 = int(np.searchsorted(offs, hi, side="left"))
            doc_start, doc_end = offs[d0:d1], offs[d0 + 1 : d1 + 1]
            starts = np.maximum(doc_start, lo)
            ends = np.minimum(doc_end, hi)
            keep = ends > starts
            starts, ends = starts[keep], ends[keep]
            pieces.append((
                starts - lo + base + got, ends - starts, np.full(len(starts), self.shard, np.int64),
                self.records[d0:d1][keep], starts - doc_start[keep], ends < doc_end[keep],
            ))
            self.pos = hi
            got += k
        return got


class EvalPipeline:
    """One global worker's batches of an evaluation pass (the interface of
    ``dataset.WorkerPipeline`` that ``StreamingLoader`` drives)."""

    def __init__(self, dataset, worker: int, num_workers: int, plan: EvalPlan) -> None:
        self.dataset = dataset
        self.plan = plan
        self.worker = worker
        self.num_workers = num_workers
        g = dataset.rank * num_workers + worker
        self.row, self.stop = plan.runs[g]
        self.quota = plan.batches_of(worker)
        self.first_step = plan.first_step
        self.batches = 0
        self.padded_rows = 0
        self.stream_base = np.concatenate([[0], np.cumsum(plan.stream_rows)]).tolist()
        self.sources: list = [None] * len(plan.streams)
        self._readers: dict[int, _DocReader] = {}

    @property
    def step(self) -> int:
        return self.first_step + self.batches * self.num_workers + self.worker

    def next_batch(self, num_rows: int, out: np.ndarray | None = None) -> RowBatch | None:
        if self.batches >= self.quota:
            return None
        cfg = self.dataset.config
        T = cfg.seq_len
        tokens = padding_rows(num_rows, T, self.dataset.token_dtype, cfg.pad_id, out)
        lookahead = np.zeros(num_rows, bool)
        parts: list[tuple] = []
        r = 0
        while r < num_rows and self.row < self.stop:
            s = int(np.searchsorted(self.stream_base, self.row, side="right")) - 1
            m = min(num_rows - r, self.stop - self.row, self.stream_base[s + 1] - self.row)
            reader = self._reader(s)
            pieces: list = []
            if self.plan.packing == "pad":
                self._pad_rows(reader, m, tokens, lookahead, r, pieces)
            else:
                self._concat_rows(reader, s, m, tokens, lookahead, r, pieces)
            parts.extend((s, p) for p in pieces)
            r += m
            self.row += m
        self.padded_rows += num_rows - r
        self.batches += 1
        return _row_batch(tokens, lookahead, parts)

    def _concat_rows(self, reader: _DocReader, s: int, m: int, tokens, lookahead, r: int, pieces) -> None:
        T = self.plan.seq_len
        flat = np.full(m * T, self.dataset.config.pad_id, tokens.dtype)
        end = min(self.plan.stream_tokens[s] - ((self.row - self.stream_base[s]) * T), m * T)
        got = reader.take(end, flat, pieces, r * T)
        if got != end:
            raise ShardCorruptError(f"stream {self.plan.streams[s]!r}: the shards hold fewer tokens than the manifest says")
        block = tokens[r : r + m]
        block[:, :T] = flat.reshape(m, T)
        block[:-1, T] = block[1:, 0]
        lookahead[r : r + m - 1] = True
        nxt = reader.peek() if got == m * T else None
        if nxt is not None:
            block[-1, T] = nxt
            lookahead[r + m - 1] = True

    def _pad_rows(self, reader: _DocReader, m: int, tokens, lookahead, r: int, pieces) -> None:
        T = self.plan.seq_len
        for i in range(m):
            k = min(T, reader.doc_left())
            row = tokens[r + i]
            got = reader.take(k, row, pieces, (r + i) * T)
            if got == T and bool(pieces[-1][5][-1]):  # the document goes on: its next token is the label
                row[T] = reader.peek()
                lookahead[r + i] = True

    def _reader(self, s: int) -> _DocReader:
        reader = self._readers.get(s)
        if reader is None:
            source = self.sources[s] = self.dataset.open_source(s)
            eos = self.dataset.config.eos_id if self.dataset.eos_appended[s] else None
            reader = self._readers[s] = _DocReader(source, s, self.plan.shard_tokens[s], eos)
            base = self.stream_base[s]
            first, last = self.row - base, min(self.stop, self.stream_base[s + 1]) - base
            reader.seek(*self._token_span(s, first, last))
        return reader

    def _token_span(self, s: int, first_row: int, stop_row: int) -> tuple[int, int]:
        """Stream tokens [start, stop) of the stream's rows [first_row, stop_row)."""
        T = self.plan.seq_len
        if self.plan.packing != "pad":
            return first_row * T, min(stop_row * T, self.plan.stream_tokens[s])
        return self._pad_token(s, first_row), self._pad_token(s, stop_row)

    def _pad_token(self, s: int, row: int) -> int:
        """Stream token offset where pad row ``row`` begins (the stream's end past its rows)."""
        T = self.plan.seq_len
        rows = np.concatenate([[0], np.cumsum(self.plan.shard_rows[s])])
        shard = int(np.searchsorted(rows, row, side="right")) - 1
        if shard >= len(self.plan.shard_rows[s]):
            return int(sum(self.plan.shard_tokens[s]))
        base = int(sum(self.plan.shard_tokens[s][:shard]))
        lengths = self._readers[s]._lengths(shard)
        per_doc = np.concatenate([[0], np.cumsum(doc_rows(lengths, T))])
        local = row - int(rows[shard])
        d = int(np.searchsorted(per_doc, local, side="right")) - 1
        return base + int(lengths[:d].sum()) + (local - int(per_doc[d])) * T

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "row": self.row}

    def check_state(self, state: dict[str, Any]) -> None:
        check_state(state, ("batches", "row"), "EvalPipeline")
        start = self.plan.runs[self.dataset.rank * self.num_workers + self.worker][0]
        if not 0 <= int(state["batches"]) <= self.quota or not start <= int(state["row"]) <= self.stop:
            raise ResumeMismatchError(
                f"EvalPipeline: worker {self.worker} at batch {state['batches']}, row {state['row']}: outside "
                f"0..{self.quota} batches and rows {start}..{self.stop} of this evaluation pass"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.close()
        self._readers.clear()
        self.sources = [None] * len(self.plan.streams)
        self.batches, self.row = int(state["batches"]), int(state["row"])

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"padded_rows": self.padded_rows}
        for name, source in zip(self.plan.streams, self.sources):
            out[name] = source.stats() if source is not None else {}
        return out

    def skipped(self) -> list:
        return []

    def close(self) -> None:
        for source in self.sources:
            if source is not None:
                source.close()


def _row_batch(tokens: np.ndarray, lookahead: np.ndarray, parts: list[tuple]) -> RowBatch:
    if parts:
        cols = [np.concatenate([p[i] for _, p in parts]) for i in range(6)]
        stream = np.concatenate([np.full(len(p[0]), s, np.int16) for s, p in parts])
    else:
        z = np.zeros(0, np.int64)
        cols = [z, z, z, z, z, np.zeros(0, bool)]
        stream = np.zeros(0, np.int16)
    start, length, shard, record, token_start, continues = cols
    return RowBatch(
        tokens=tokens, lookahead=lookahead, start=start.astype(np.int64), length=length.astype(np.int64),
        stream=stream, shard=shard.astype(np.int32), record=record.astype(np.int64),
        token_start=token_start.astype(np.int64), continues=continues.astype(bool),
    )


def check_eval_config(packing: str, infinite: bool, eval_tokens: int | None) -> None:
    if packing in ("bestfit", "balance"):
        raise ConfigError(
            f"packing={packing!r} cannot be used with evaluation=True: its rows depend on the documents "
            "each worker's window holds, so the loss would change with the topology; use 'concat' or 'pad'"
        )
    if infinite:
        raise ConfigError("evaluation=True makes one pass over the held-out streams; infinite=True does not apply")
    if eval_tokens is not None and int(eval_tokens) < 1:
        raise ConfigError(f"eval_tokens must be >= 1, got {eval_tokens}")
