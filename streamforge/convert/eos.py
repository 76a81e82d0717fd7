"""Do the source's documents already end with the EOS id? The converter decides it once.

The manifest's ``docs_end_with_eos`` tells the pipeline whether to append ``eos_id`` to each
document: a stream whose documents already end with EOS must say ``true``, or every document
trains on a second EOS. The converter finds out from the document ends alone (one gathered
token per document, positions from the index or offsets; no scan of the documents), with
``docs_end_with_eos`` = ``"auto"`` (default), ``"yes"`` or ``"no"``:

``auto``
    ``yes`` when every non-empty document ends with ``eos_id`` (Megatron ``--append-eod``),
    ``no`` when none does; a mix is a ``SourceError`` naming the input and both counts, since
    either answer would be wrong for part of the corpus. Without an EOS id nothing can be
    checked and the answer is ``no``, as before. Flat files and EOS-split npy arrays are
    ``yes`` by construction (each document keeps the EOS it was split at); a final document
    after the last EOS is kept as it is.
``yes``
    Every non-empty document ends with EOS in the stream: EOS is appended at conversion to
    each one that lacks it (the count is recorded). Needs an EOS id.
``no``
    The pipeline appends EOS to every document; documents that already end with it get a
    second one (the count is recorded). Refused for EOS-split sources, whose documents end
    with EOS by construction.

Zero-length documents count for neither side and stay zero-token records. The decision and
its counts go into the manifest's ``conversion["eos_check"]``; ``describe`` renders them for
``streamforge inspect``. Manifests without that entry (written before it existed, or by
``ShardWriter``) are read exactly as before: ``docs_end_with_eos`` alone decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, SourceError
from .base import ArraySource

MODES = ("auto", "yes", "no")
FLAG = "--docs-end-with-eos"


def normalize_mode(mode: Any) -> str:
    """``"auto"``, ``"yes"`` or ``"no"`` from a string or a bool (True = yes)."""
    if mode is None:
        return "auto"
    if isinstance(mode, (bool, np.bool_)):
        return "yes" if mode else "no"
    if isinstance(mode, str) and mode.strip().lower() in MODES:
        return mode.strip().lower()
    raise ConfigError(f"docs_end_with_eos must be one of {', '.join(MODES)} (or a bool), got {mode!r}")


@dataclass(frozen=True)
class EosDecision:
    """What the manifest says, why, and which documents get EOS appended at conversion."""

    docs_end_with_eos: bool
    record: dict[str, Any]  # conversion["eos_check"]
    append: np.ndarray | None = None  # bool per source document; None: nothing appended


def decide(source: ArraySource, num_docs: int, mode: Any = "auto") -> EosDecision:
    """The EOS decision for the first ``num_docs`` documents of ``source`` (see the module doc)."""
    mode = normalize_mode(mode)
    eos = source.eos_id
    record: dict[str, Any] = {"requested": mode, "eos_id": eos}
    split_at_eos = source.params.get("split") == "eos"

    if eos is None:
        if mode == "yes":
            raise ConfigError(
                f"{source.where}: {FLAG} yes needs --eos-id (the id to check for, and to append "
                "where a document lacks it)"
            )
        record["decided_by"] = "requested" if mode == "no" else "eos_unknown"
        return EosDecision(False, record)

    if split_at_eos:
        # Every document but a final tail ends with the EOS it was split at.
        nonempty = source.source_lengths()[:num_docs] > 0
        ends = nonempty.copy()
        if num_docs == source.num_docs and nonempty[-1]:
            last = int(source.seq_starts[-1] + source.seq_lengths[-1] - 1)
            ends[-1] = int(source.tokens[last]) == eos
    else:
        nonempty, ends = source.ends_with(eos, num_docs)
    with_eos = int(ends.sum())
    without = int(nonempty.sum()) - with_eos
    record.update(
        docs_with_eos=with_eos,
        docs_without_eos=without,
        empty_docs=int(num_docs - nonempty.sum()),
    )
    lacking = nonempty & ~ends

    if split_at_eos:
        if mode == "no":
            hint = " (use --offsets to split this array otherwise)" if source.format == "npy" else ""
            raise ConfigError(
                f"{source.where}: documents are split after each EOS id {eos} and keep it, so "
                f"they end with EOS; {FLAG} no would make the pipeline append a second one{hint}"
            )
        if mode == "yes" and without:
            record.update(decided_by="requested", eos_appended=without)
            return EosDecision(True, record, _full_mask(lacking, source.num_docs))
        record.update(decided_by="split_at_eos", eos_appended=0)
        return EosDecision(True, record)

    if mode == "yes":
        record.update(decided_by="requested", eos_appended=without)
        return EosDecision(True, record, _full_mask(lacking, source.num_docs) if without else None)
    if mode == "no":
        record.update(decided_by="requested", eos_appended=0)
        return EosDecision(False, record)
    if without == 0 and with_eos:
        record.update(decided_by="detected", eos_appended=0)
        return EosDecision(True, record)
    if with_eos == 0:
        record.update(decided_by="detected", eos_appended=0)
        return EosDecision(False, record)
    first_with = int(np.flatnonzero(ends)[0])
    first_without = int(np.flatnonzero(lacking)[0])
    raise SourceError(
        f"{source.where}: {with_eos:,} of {with_eos + without:,} non-empty documents end with "
        f"EOS id {eos} (the first is document {first_with}) and {without:,} do not (the first "
        f"is document {first_without}), so it cannot be told whether the pipeline should append "
        f"EOS. Pass {FLAG} yes (EOS is appended at conversion to the {without:,} that lack it) "
        f"or {FLAG} no (the pipeline appends EOS to every document, a second one to the "
        f"{with_eos:,} that have it)"
    )


def _full_mask(mask: np.ndarray, num_docs: int) -> np.ndarray:
    """``mask`` over the first documents, padded with False to every document of the source."""
    out = np.zeros(num_docs, bool)
    out[: len(mask)] = mask
    return out


def describe(manifest: Any) -> str:
    """One line for ``inspect``: do documents end with EOS, how that was decided, what the
    pipeline does about it."""
    check = (manifest.conversion or {}).get("eos_check")
    answer = "yes" if manifest.docs_end_with_eos else "no"
    action = (
        "the pipeline appends none"
        if manifest.docs_end_with_eos
        else "the pipeline appends EOS to every document"
    )
    if not isinstance(check, dict):
        return f"{answer} (as recorded in the manifest; {action})"
    how = check.get("decided_by")
    eos = check.get("eos_id")
    with_eos, without = check.get("docs_with_eos", 0), check.get("docs_without_eos", 0)
    appended = check.get("eos_appended", 0)
    if how == "eos_unknown":
        why = "not checked: no EOS id was given at conversion"
    elif how == "split_at_eos":
        why = f"split after each EOS id {eos}"
        if without:
            why += "; the final document has none"
    elif how == "detected":
        total = with_eos + without
        why = (
            f"detected: all {total:,} non-empty documents end with EOS id {eos}"
            if manifest.docs_end_with_eos
            else f"detected: none of the {total:,} non-empty documents ends with EOS id {eos}"
        )
    elif how == "tokenizer":
        why = f"tokenized from text: EOS id {eos} ends every non-empty document (added by the {check.get('appended_by')})"
    elif manifest.docs_end_with_eos:
        why = f"{FLAG} yes; EOS appended at conversion to {appended:,} documents"
    else:
        why = f"{FLAG} no"
        if with_eos:
            why += f"; {with_eos:,} documents already end with EOS id {eos} and get a second one"
    return f"{answer} ({why}; {action})"
