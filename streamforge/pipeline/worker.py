"""One global worker's stages, assembled on the job clock::

    plan -> ShardReader -> ShuffleBuffer  (one pair per stream)
                                   \\
                                    Interleaver (token-share deficit) -> Packer -> RowBatch
"""

from __future__ import annotations

from typing import Any, Sequence, TypedDict

import numpy as np

from ..errors import ResumeMismatchError
from ..planning.plan import PassPlan
from ..planning.planner import worker_work
from ..stages.balance import BalancedPacker, saved_end
from ..stages.base import check_state
from ..stages.interleave import Interleaver
from ..stages.pack import STATE_KEYS as PACKER_KEYS, Packer, PackerState
from ..stages.read import ShardReader
from ..stages.shuffle import ShuffleBuffer, ShuffleState
from .batch import RowBatch, pad_to_rows


class WorkerState(TypedDict):
    """A saved ``WorkerPipeline``: the ``batches`` it built in its pass and its packer's state,
    which nests the interleaver's and, in it, one shuffle buffer's per stream::

        {"batches": n, "packer": {"source": {..., "sources": [{"reader": {...}, ...}, ...]}, ...}}
    """

    batches: int
    packer: PackerState


STATE_KEYS: tuple[str, ...] = tuple(WorkerState.__annotations__)  # the keys of a saved state


class WorkerPipeline:
    """The stages of one global worker, with their joint state, on the job clock.

    The pipeline builds its worker's batches of the rank's sequence: its ``j``-th batch has
    global step ``first_step + j * W + worker`` (``plan.PassPlan.step_of``); the interleaver
    is told that step before the batch is built. In a finite pass, ``quota`` is the number of
    batches this worker builds (``PassPlan.batches_of``); every one is full. ``work`` is the
    plan of the rest of a pass after an elastic resume (``elastic.py``): in that pass the
    worker reads its share of the work left, saved windows' rests first.
    """

    def __init__(
        self, dataset: Any, worker: int, num_workers: int, first_pass: int, *,
        quota: int | None = None, first_step: int = 0, work: PassPlan | None = None,
    ) -> None:
        cfg = dataset.config
        self.dataset = dataset
        self.worker = worker
        self.num_workers = num_workers
        self.global_worker = dataset.rank * num_workers + worker
        self.num_global_workers = dataset.world_size * num_workers
        self.quota = quota
        self.first_step = first_step
        self.batches = 0  # batches built in this pass (since the start, when infinite)
        self.padded_rows = 0
        self.padding_tokens = 0  # positions of padding in its batches (a pass's padded last step)
        self.sources = []
        buffers = []
        assigned = None if work is None else list(zip(work.ranges, work.windows))
        for i, stream in enumerate(dataset.streams):
            source = dataset.open_source(i)
            ranges_for, windows_for = worker_work(
                dataset.planner, i, self.num_global_workers, self.global_worker, -1 if work is None else work.pass_idx,
                assigned,
            )
            reader = ShardReader(
                source, ranges_for=ranges_for, stream_key=stream.name, infinite=cfg.infinite,
                first_pass=first_pass,
            )
            eos = cfg.eos_id if dataset.eos_appended[i] else None
            buffers.append(ShuffleBuffer(
                reader, size=cfg.shuffle_buffer, seed=cfg.seed, stream_key=stream.name,
                global_worker=self.global_worker, eos_id=eos, windows_for=windows_for,
                generation=dataset.resume_generation, warmup=cfg.shuffle_warmup,
            ))
            self.sources.append(source)
        self.buffers = buffers
        self.interleaver = Interleaver(buffers, dataset.schedule)
        self.seq_lens = dataset.seq_lens  # the row length by step (planning/steps.py)
        if cfg.packing == "balance":
            self.packer = BalancedPacker(self.interleaver, seq_len=self.seq_lens.at(self.step),
                                         target=dataset.balance_target, pad_id=cfg.pad_id, dtype=dataset.token_dtype)
        else:
            self.packer = Packer(
                self.interleaver, seq_len=self.seq_lens.at(self.step), mode=cfg.packing, pad_id=cfg.pad_id,
                dtype=dataset.token_dtype, bestfit_window=cfg.bestfit_window, varies=self.seq_lens.constant is None,
            )

    @property
    def step(self) -> int:
        """The global step of the next batch this pipeline builds."""
        return self.first_step + self.batches * self.num_workers + self.worker

    def next_batch(self, num_rows: int, out: np.ndarray | None = None) -> RowBatch | None:
        """The next batch (rows of the row length at its step), or None when this worker's
        share of the pass is done. With a quota, a batch the data cannot fill (records
        skipped as damaged) is padded to full shape, counted in ``stats()["padded_rows"]``,
        so every rank still has every step.
        ``out``: where to build the tokens, if the batch fits (``Packer.next_rows``)."""
        if self.quota is not None and self.batches >= self.quota:
            return None
        step = self.first_step + self.batches * self.num_workers + self.worker
        self.interleaver.set_step(step)
        seq_len = self.seq_lens.constant
        if seq_len is None:  # a seq_len schedule: this step's row length
            seq_len = self.seq_lens.at(step)
            self.packer.set_seq_len(seq_len)
        rows = self.packer.next_rows(num_rows, out)
        if self.quota is not None:
            got = 0 if rows is None else rows.num_rows
            if got < num_rows:
                self.padded_rows += num_rows - got
                rows = pad_to_rows(rows, num_rows, seq_len, self.dataset.token_dtype, self.dataset.config.pad_id)
            self.padding_tokens += num_rows * seq_len - sum(rows.length.tolist())  # a few dozen pieces
        if rows is None:
            return None
        self.batches += 1
        return rows

    def state_dict(self) -> WorkerState:
        return {"batches": self.batches, "packer": self.packer.state_dict()}

    def check_state(self, state: WorkerState) -> None:
        """Raise ``ResumeMismatchError`` naming the stage and value a state gets wrong
        (reads record indexes, never tokens; leaves this pipeline unusable)."""
        self._check_own(state)
        self.packer.check_state(state["packer"])

    def _check_own(self, state: WorkerState) -> None:
        check_state(state, STATE_KEYS, "WorkerPipeline")
        batches = int(state["batches"])
        if batches < 0 or (self.quota is not None and batches > self.quota):
            raise ResumeMismatchError(
                f"WorkerPipeline: worker {self.worker} has built {batches} batches, outside "
                f"0..{self.quota} of this pass"
            )

    def load_state_dict(self, state: WorkerState) -> None:
        self._check_own(state)
        self.batches = int(state["batches"])
        self.packer.load_state_dict(state["packer"])

    @staticmethod
    def stream_states(state: WorkerState) -> list[ShuffleState]:
        """Each stream's shuffle-buffer state nested in a saved pipeline state (the one walk
        down the nesting: read a stream's cursor from it with ``ShuffleBuffer.saved_cursor``)."""
        check_state(state, STATE_KEYS, "WorkerPipeline")
        check_state(state["packer"], PACKER_KEYS, "Packer")
        return Interleaver.source_states(saved_end(state["packer"]))

    def seek(self, positions: Sequence[tuple[int, int]]) -> None:
        """Start each stream ``records`` into this worker's ranges of ``pass`` (one
        ``(pass, records)`` per stream), at a window boundary; used by statistical resume."""
        for buffer, (pass_idx, records) in zip(self.buffers, positions):
            buffer.seek(pass_idx, records)
        self.interleaver.forget_schedule()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"truncated_tokens": self.packer.truncated_tokens, "padded_rows": self.padded_rows,
                               "padding_tokens": self.padding_tokens}
        for stream, source in zip(self.dataset.streams, self.sources):
            stats = source.stats() if callable(getattr(source, "stats", None)) else {}
            out[stream.name] = stats
        return out

    def skipped(self) -> list[dict[str, Any]]:
        out = []
        for stream, source in zip(self.dataset.streams, self.sources):
            for item in getattr(source, "skipped", []) or []:
                out.append({"stream": stream.name, **item})
        return out

    def close(self) -> None:
        for source in self.sources:
            close = getattr(source, "close", None)
            if close is not None:
                close()
