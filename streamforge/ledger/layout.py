"""The ledger's layout on storage: names, columns, and the listing of headers and chunks
(``store.py`` writes them, ``read.py`` reads them)."""

from __future__ import annotations

import operator
import re

import numpy as np

from ..storage.open import join

FORMAT = "streamforge-ledger"
VERSION = 1
DEFAULT_CHUNK_STEPS = 256
GEN_RE = re.compile(r"gen-(\d{6,})")
HEADER_RE = re.compile(r"rank(\d{5,})\.json")  # generations/gen-NNNNNN/rankNNNNN.json
CHUNK_RE = re.compile(r"gen-(\d{6,})-(\d{6,})\.npz")  # rankNNNNN/gen-NNNNNN-SSSSSS.npz
RANK_RE = re.compile(r"rank(\d{5,})")
GENERATIONS = "generations"

# per piece, as stored: name -> dtype (the RowBatch field of the same name)
PIECE_COLUMNS = {
    "start": np.int64, "length": np.int64, "stream": np.int16, "shard": np.int32,
    "record": np.int64, "token_start": np.int64, "continues": np.bool_,
}
# per step: name -> dtype
STEP_COLUMNS = {"step": np.int64, "pass": np.int32, "skipped": np.bool_, "num_pieces": np.int64}

STEP_DTYPE = np.dtype(list(STEP_COLUMNS.items()))
PIECE_DTYPE = np.dtype(list(PIECE_COLUMNS.items()))
piece_columns = operator.attrgetter(*PIECE_COLUMNS)


def rank_dir(rank: int) -> str:
    return f"rank{rank:05d}"


def last_generation(fs, root: str) -> int:
    """The largest generation number with a header under ``root`` (-1: none). One listing
    of ``generations/`` (a folder per generation), however many chunks the ledger holds."""
    folder = join(root, GENERATIONS)
    fs.invalidate_cache(folder)
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(folder, detail=False)]
    except FileNotFoundError:
        return -1
    return max((int(m.group(1)) for n in names if (m := GEN_RE.fullmatch(n))), default=-1)


def list_ledger(fs, root: str) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, int, str]]]:
    """Headers ``(generation, rank, path)`` and chunks ``(generation, rank, seq, path)``
    under ``root``; anything else (temporary files, other names) is left out."""
    fs.invalidate_cache(root)
    try:
        paths = fs.find(root)
    except FileNotFoundError:
        return [], []
    headers, chunks = [], []
    for path in paths:
        parts = path.rstrip("/").rsplit("/", 3)
        if len(parts) < 3:
            continue
        if len(parts) == 4 and parts[1] == GENERATIONS and (g := GEN_RE.fullmatch(parts[2])) and (
                r := HEADER_RE.fullmatch(parts[3])):
            headers.append((int(g.group(1)), int(r.group(1)), path))
        elif (r := RANK_RE.fullmatch(parts[-2])) and (c := CHUNK_RE.fullmatch(parts[-1])):
            chunks.append((int(c.group(1)), int(r.group(1)), int(c.group(2)), path))
    return sorted(headers), sorted(chunks)

