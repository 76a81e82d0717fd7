"""DocRun: what the shuffle buffers and the interleaver hand the packer.

A run is consecutive pieces of documents: their tokens held as views of the frames they were
decoded into (and the EOS after each document), so the packer copies each token once, into
its batch (``copy_into``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class DocRun:
    """Consecutive pieces of documents of one stream (or, with ``streams``, of several
    streams interleaved): ``size`` tokens held as ``parts`` (views of the decoded frames,
    and the EOS after each document), in order.

    Args:
        parts: the tokens, as arrays laid end to end.
        size: the number of tokens in ``parts``.
        shard, record: each piece's document.
        token_start: each piece's offset in its document.
        length: each piece's tokens (an EOS counts to its document).
        done: the last piece ends its document.
        streams: each piece's stream, where a run mixes streams (else None).
        span: where a run of one window lies in it, its parts being made only when asked
            for (``take_parts``): ``(window, pos, docs, token_offset, first, stop, done)``;
            the compiled core copies the tokens from the window's frames instead
            (``copy_into_grid``).
    """

    parts: list
    size: int
    shard: np.ndarray
    record: np.ndarray
    token_start: np.ndarray
    length: np.ndarray
    done: bool
    streams: np.ndarray | None = None
    span: tuple | None = None

    def take_parts(self) -> list:
        """The parts, made from the window's frames where the run holds a ``span``."""
        if self.parts is None and self.span is not None:
            window, *where = self.span
            self.parts = window.run_parts(*where)
        return self.parts

    def release(self) -> None:
        """Let go of the run's frames (its tokens are copied)."""
        self.parts = self.span = None

    def copy_into(self, out: np.ndarray) -> None:
        """Write the run's tokens into ``out`` (``size`` long): one copy of each token."""
        parts = self.take_parts()
        if len(parts) == 1:
            out[...] = parts[0]
        elif parts:
            np.concatenate(parts, out=out)

    def copy_into_grid(self, ext, grid: np.ndarray, filled: int) -> int | None:
        """Write the run's tokens into the [R, T+1] ``grid`` from flat position ``filled`` with
        the compiled core ``ext`` (rows wrap); the tokens written, or None where the core
        leaves the run to ``copy_into`` (nothing written)."""
        if self.span is not None and self.parts is None:
            window, pos, _, token_offset, _, _, _ = self.span
            return window.fill(ext, pos, token_offset, self.size, grid, filled)
        return ext.fill_rows(self.parts, grid, filled)

    @property
    def tokens(self) -> np.ndarray:
        parts = self.take_parts()
        out = np.empty(self.size, parts[0].dtype if parts else np.uint16)
        self.copy_into(out)
        return out
