"""What a reader refuses: checks of a manifest's shard table and of a shard's record index.

A manifest and a shard index are file contents, so nothing in them is trusted. Each is checked
once, when it is read, with a few vectorized numpy passes over its columns (for a manifest, a
fraction of the cost of parsing its JSON; docs/format.md, "What a reader refuses", gives the
cost), never per record per batch. A failure names the stream, the shard and the field, and the record or frame
at fault: ``ManifestError`` for the manifest, ``ShardCorruptError`` for an index.

The record index holds nothing the record lengths do not decide: the writer's layout
(``tar.py``) places every member, so each ``token_offset``, ``meta_offset`` and frame
``raw_size`` follows from the ``num_tokens`` and ``meta_size`` before it. ``check_index``
recomputes them all, so a flipped bit anywhere in an index is refused; docs/format.md ("What a
reader refuses") lists every rule, and says why the manifest carries no checksum of the index.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from ..errors import ManifestError, ShardCorruptError
from .frames import FRAME_DTYPE, RECORD_DTYPE, ShardIndex, frame_table_bytes
from .tar import BLOCK, END_OF_ARCHIVE, npy_header_sizes, records_nbytes


MAX_SHARDS = 1 << 22  # with the per-shard limits below, every total fits in an int64
MAX_SHARD_BYTES = 1 << 40
MAX_SHARD_TOKENS = 1 << 40
U32_MAX = (1 << 32) - 1  # the index stores record and frame counts, and frame sizes, as u32
MAX_NAME_CHARS = 200
# A shard name is a plain file name inside the stream's prefix: no separator, no scheme, no
# "..", nothing a shell or URL parser reads specially. Checked on all names at once, joined.
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_NAME_RE = re.compile(_NAME)
_NAMES_RE = re.compile(rf"(?:{_NAME}\n)*{_NAME}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_DIGESTS_RE = re.compile(r"(?:[0-9a-f]{64}\n)*[0-9a-f]{64}")


def plain_name(name: Any) -> bool:
    """True for a name a manifest may give a shard (a plain file name: module docstring)."""
    return (
        isinstance(name, str) and len(name) <= MAX_NAME_CHARS and ".." not in name
        and _NAME_RE.fullmatch(name) is not None
    )


# -- the manifest ---------------------------------------------------------------------------
def check_header(data: dict[str, Any], where: str) -> None:
    """The manifest's fields outside the shard table have the types and ranges they must."""
    dtype = np.dtype(data["token_dtype"])
    top = int(np.iinfo(dtype).max)
    for key, low, high in (("eos_id", 0, top), ("vocab_size", 1, top + 1)):
        value = data.get(key)
        if value is not None and (type(value) is not int or not low <= value <= high):
            raise ManifestError(f"{where}: {key} is {show_value(value)}, must be null or an integer in {low}..{high}")
    for key, kind in (("docs_end_with_eos", bool), ("conversion", dict), ("tokenizer", dict),
                      ("source_fingerprint", str)):
        value = data.get(key)
        if value is not None and not isinstance(value, kind):
            raise ManifestError(f"{where}: {key} is {show_value(value)}, must be null or a {kind.__name__}")
    for key in ("num_shards", "num_records", "num_tokens", "num_bytes"):
        value = data.get(key)
        if key in data and (type(value) is not int or value < 0):
            raise ManifestError(f"{where}: {key} is {show_value(value)}, must be an integer >= 0")


def shard_table(
    shards: Any, columns_wanted: tuple[str, ...], optional: tuple[str, ...], where: str
) -> tuple[list[str], list[str], dict[str, np.ndarray]]:
    """``(names, sha256 digests, int64 columns)`` of a manifest's ``shards`` object, each
    column checked for its type; ``check_rows`` checks the values."""
    if not isinstance(shards, dict):
        raise ManifestError(f"{where}: malformed shard table (shards is {show_value(shards)}, must be an object of columns)")
    keys = ("name", "sha256", *columns_wanted)
    missing = [k for k in keys if k not in shards]
    if missing:
        raise ManifestError(f"{where}: malformed shard table (no column {missing[0]!r})")
    keys += tuple(k for k in optional if k in shards)
    for key in keys:
        if not isinstance(shards[key], list):
            raise ManifestError(f"{where}: malformed shard table (shards.{key} is {show_value(shards[key])}, must be a list)")
    lengths = {k: len(shards[k]) for k in keys}
    if len(set(lengths.values())) != 1:
        said = ", ".join(f"{k} {n}" for k, n in lengths.items())
        raise ManifestError(f"{where}: shard table columns have different lengths ({said})")
    if lengths["name"] > MAX_SHARDS:
        raise ManifestError(f"{where}: {lengths['name']} shards, at most {MAX_SHARDS} are read")
    names = _names(shards["name"], where)
    digests = _digests(shards["sha256"], names, where)
    columns = {k: _int_column(shards[k], k, names, where) for k in keys[2:]}
    return names, digests, columns


def check_rows(columns: dict[str, np.ndarray], names: list[str], itemsize: int, compression: str,
               where: str) -> None:
    """Every count and size of every shard is in range and agrees with the others: the index
    is the shard's last ``index_bytes``, which its frame and record counts decide."""
    c = columns
    size, records, tokens = c["bytes"], c["num_records"], c["num_tokens"]
    frames, index_offset, index_bytes = c["num_frames"], c["index_offset"], c["index_bytes"]

    def refuse(bad: np.ndarray, key: str, rule: Callable[[int], str]) -> None:
        if bad.any():
            i = int(np.argmax(bad))
            raise ManifestError(f"{where}: shard {i} ({names[i]}): {key} is {int(c[key][i])}, {rule(i)}")

    refuse((size < 1) | (size > MAX_SHARD_BYTES), "bytes", lambda i: f"must be 1..{MAX_SHARD_BYTES}")
    refuse((records < 0) | (records > U32_MAX), "num_records", lambda i: f"must be 0..{U32_MAX}")
    refuse((frames < 1) | (frames > U32_MAX), "num_frames", lambda i: f"must be 1..{U32_MAX}")
    refuse((tokens < 0) | (tokens > MAX_SHARD_TOKENS), "num_tokens", lambda i: f"must be 0..{MAX_SHARD_TOKENS}")
    refuse(index_offset < 0, "index_offset", lambda i: "must be >= 0")
    expected = frame_table_bytes(0) + frames * FRAME_DTYPE.itemsize + records * RECORD_DTYPE.itemsize
    refuse(index_bytes != expected, "index_bytes", lambda i: (
        f"must be {int(expected[i])} for an index of {int(frames[i])} frames and {int(records[i])} records"))
    refuse(index_offset + index_bytes != size, "index_offset", lambda i: (
        f"must be bytes - index_bytes = {int(size[i] - index_bytes[i])}: the index ends the shard"))
    # (ceiling divisions: records * U32_MAX would pass the int64 range)
    refuse(-(-tokens // U32_MAX) > records, "num_tokens", lambda i: f"more than {int(records[i])} records can hold")
    token_bytes = tokens * itemsize
    if compression == "zstd":  # each frame decodes to at most U32_MAX bytes
        refuse(-(-token_bytes // U32_MAX) > frames, "num_tokens",
               lambda i: f"more than {int(frames[i])} frames of at most {U32_MAX} bytes can hold")
    else:  # the frames are the raw bytes before the index
        refuse(token_bytes > index_offset, "num_tokens",
               lambda i: f"more than its {int(index_offset[i])} bytes of frames can hold")
    docs = c.get("num_docs")
    if docs is not None:
        refuse((docs < 0) | (docs > records), "num_docs", lambda i: f"must be 0..num_records ({int(records[i])})")
        refuse(docs > tokens, "num_docs", lambda i: f"more non-empty records than its {int(tokens[i])} tokens")
        refuse((docs == 0) & (tokens > 0), "num_docs", lambda i: f"but its {int(tokens[i])} tokens need a non-empty record")


def _names(values: list, where: str) -> list[str]:
    """The shard names, each a plain name (``plain_name``), none listed twice."""
    ok = bool(values)
    if ok:
        try:
            text = "\n".join(values)
        except TypeError:
            ok = False
        else:  # one regex pass over all names; a name holding "\n" adds a line
            ok = (_NAMES_RE.fullmatch(text) is not None and text.count("\n") == len(values) - 1
                  and ".." not in text and max(map(len, values)) <= MAX_NAME_CHARS)
    if not ok and values:
        i = next(i for i, name in enumerate(values) if not plain_name(name))
        raise ManifestError(
            f"{where}: shard {i}: name {show_value(values[i])} is not a plain file name in the stream's "
            f"prefix (letters, digits, '.', '_', '-', at most {MAX_NAME_CHARS}; no '/', '..' or scheme)"
        )
    if len(set(values)) != len(values):
        first: dict[str, int] = {}
        for j, name in enumerate(values):
            if name in first:
                raise ManifestError(f"{where}: shard {j} ({name}): name is listed twice (also shard {first[name]})")
            first[name] = j
    return list(values)


def _digests(values: list, names: list[str], where: str) -> list[str]:
    try:
        ok = not values or _DIGESTS_RE.fullmatch("\n".join(values)) is not None
    except TypeError:
        ok = False
    ok = ok and (not values or max(map(len, values)) == 64)
    if not ok:
        i = next(i for i, v in enumerate(values) if not (isinstance(v, str) and _DIGEST_RE.fullmatch(v)))
        raise ManifestError(f"{where}: shard {i} ({names[i]}): sha256 is {show_value(values[i])}, must be 64 lowercase hex digits")
    return list(values)


def _int_column(values: list, key: str, names: list[str], where: str) -> np.ndarray:
    """``values`` as int64, or a ``ManifestError`` naming the first entry that is not an integer
    (a float, a string, a bool, a list, or one past the int64 range)."""
    if not values:
        return np.zeros(0, np.int64)
    try:
        array = np.asarray(values)
    except (ValueError, TypeError, OverflowError, RecursionError):
        array = None
    if array is None or array.ndim != 1 or array.dtype.kind not in "iu" or (
        array.dtype.kind == "u" and int(array.max()) > np.iinfo(np.int64).max
    ):
        limit = 1 << 63
        i = next((i for i, v in enumerate(values) if type(v) is not int or not -limit <= v < limit), 0)
        raise ManifestError(f"{where}: shard {i} ({names[i]}): {key} is {show_value(values[i])}, must be an integer (int64)")
    return array.astype(np.int64, copy=False)


def show_value(value: Any) -> str:
    """``repr(value)`` cut to a readable length (junk can be megabytes long)."""
    text = repr(value) if not isinstance(value, (dict, list)) else f"a {type(value).__name__}"
    return text if len(text) <= 90 else text[:87] + "..."


# -- a shard's record index ---------------------------------------------------------------------
def check_index(index: ShardIndex, manifest: Any, shard: int, where: str) -> None:  # manifest: a Manifest
    """Raise ``ShardCorruptError`` unless a decoded shard index agrees with the manifest's row
    (counts, where the frames end, non-empty records), its frames tile the bytes before it,
    its records' tokens sum to its header's count, and every offset and frame size is the one
    the records' lengths give (module docstring). ``where`` names the stream and the shard."""
    col = manifest.columns
    frames, records = index.frames, index.records
    ends = frames["comp_offset"].astype(np.int64) + frames["comp_size"]
    problems = [
        (index.num_records, int(col["num_records"][shard]), "records"),
        (index.num_frames, int(col["num_frames"][shard]), "frames"),
        (index.num_tokens, int(col["num_tokens"][shard]), "tokens"),
        (int(ends[-1]) if len(ends) else 0, int(col["index_offset"][shard]), "bytes of frames"),
    ]
    for found, expected, what in problems:
        if found != expected:
            raise ShardCorruptError(f"{where}: index lists {found} {what}, manifest {expected}")
    if not len(frames):
        raise ShardCorruptError(f"{where}: index lists no frame")
    if frames["comp_offset"][0] != 0 or np.any(frames["comp_offset"][1:] != ends[:-1]):
        raise ShardCorruptError(f"{where}: index frames are not contiguous")
    starts = index.first_records
    if starts[0] != 0 or np.any(np.diff(starts) < 0) or starts[-1] > len(records):
        raise ShardCorruptError(f"{where}: index frames do not start at record 0 in order")
    lengths = records["num_tokens"].astype(np.int64)
    meta_size = records["meta_size"].astype(np.int64)
    itemsize = np.dtype(manifest.token_dtype).itemsize
    frame_of = index.frame_of_record(np.arange(len(records)))
    room = frames["raw_size"].astype(np.int64)[frame_of]
    token_end = records["token_offset"].astype(np.int64) + lengths * itemsize
    meta_end = records["meta_offset"].astype(np.int64) + meta_size
    outside = (token_end > room) | ((meta_size > 0) & (meta_end > room))
    if outside.any():
        r = int(np.argmax(outside))
        raise ShardCorruptError(
            f"{where}: index puts record {r} outside its frame {int(frame_of[r])} ({int(room[r])} bytes)"
        )
    total = int(lengths.sum())
    if total != index.num_tokens:
        raise ShardCorruptError(
            f"{where}: index records' num_tokens sum to {total}, its header and the manifest say "
            f"{index.num_tokens}"
        )
    if "num_docs" in col and int(np.count_nonzero(lengths)) != int(col["num_docs"][shard]):
        raise ShardCorruptError(
            f"{where}: index holds {int(np.count_nonzero(lengths))} non-empty records, manifest "
            f"num_docs {int(col['num_docs'][shard])}"
        )
    _check_layout(index, lengths, meta_size, frame_of, itemsize, where)


def _check_layout(index: ShardIndex, lengths: np.ndarray, meta_size: np.ndarray, frame_of: np.ndarray,
                  itemsize: int, where: str) -> None:
    """Every record's offsets and every frame's ``raw_size`` are those the writer's layout gives
    the records' lengths: members end to end from each frame's start, the archive's two zero
    blocks closing the last frame."""
    records, frames = index.records, index.frames
    npy_bytes = records_nbytes(lengths, itemsize)
    sizes = npy_bytes + np.where(meta_size > 0, BLOCK + meta_size + (-meta_size) % BLOCK, 0)
    start = np.zeros(len(records) + 1, np.int64)
    np.cumsum(sizes, out=start[1:])
    firsts = index.first_records
    pos = start[:-1] - start[firsts[frame_of]]
    heads = npy_header_sizes(lengths, np.dtype(f"<u{itemsize}"))
    for field, expected in (
        ("token_offset", pos + BLOCK + heads),
        ("meta_offset", np.where(meta_size > 0, pos + npy_bytes + BLOCK, 0)),
    ):
        wrong = records[field] != expected
        if wrong.any():
            r = int(np.argmax(wrong))
            raise ShardCorruptError(
                f"{where}: index record {r}: {field} is {int(records[field][r])}, the records before "
                f"it in frame {int(frame_of[r])} put it at {int(expected[r])}"
            )
    stops = np.append(firsts[1:], len(records))
    raw = start[stops] - start[firsts]
    raw[-1] += len(END_OF_ARCHIVE)
    wrong = frames["raw_size"] != raw
    if wrong.any():
        f = int(np.argmax(wrong))
        raise ShardCorruptError(
            f"{where}: index frame {f}: raw_size is {int(frames['raw_size'][f])}, its records "
            f"{int(firsts[f])}..{int(stops[f]) - 1} take {int(raw[f])} bytes"
        )
