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
    """

    parts: list
    size: int
    shard: np.ndarray
    record: np.ndarray
    token_start: np.ndarray
    length: np.ndarray
    done: bool
    streams: np.ndarray | None = None

    def copy_into(self, out: np.ndarray) -> None:
        """Write the run's tokens into ``out`` (``size`` long): one copy of each token."""
        if len(self.parts) == 1:
            out[...] = self.parts[0]
        elif self.parts:
            np.concatenate(self.parts, out=out)

    @property
    def tokens(self) -> np.ndarray:
        out = np.empty(self.size, self.parts[0].dtype if self.parts else np.uint16)
        self.copy_into(out)
        return out
