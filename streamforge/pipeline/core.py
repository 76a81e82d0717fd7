"""Which implementation runs the per-batch hot loops: the compiled core or the numpy path.

The compiled core (``streamforge.pipeline._core``, built from ``_core.c`` by setup.py when a
C compiler is at hand) fills the batch contract's tensors in one pass (``batch.expand``) and
writes the concat packer's rows straight from the decoded frames (``Packer._concat_rows``).
The numpy path is the reference: the compiled core gives the same batches and states, bit for
bit (tests/test_core_equivalence.py), and hands any layout it does not take back to it.

The numpy path runs where the extension is not built, or where the environment variable
``STREAMFORGE_NO_EXT`` is set to anything but ``""`` or ``"0"`` (read at import, so worker
processes follow their parent). ``StreamingLoader.stats()["core"]`` says which one runs.
Tests switch paths in one process by setting ``ext`` (the module, or None).
"""

from __future__ import annotations

import os
from types import ModuleType


def _load() -> ModuleType | None:
    """The compiled core, or None where it is not built or ``STREAMFORGE_NO_EXT`` asks for numpy."""
    if os.environ.get("STREAMFORGE_NO_EXT", "") not in ("", "0"):
        return None
    try:
        from . import _core
    except ImportError:
        return None
    return _core


ext: ModuleType | None = _load()  # what batch.py and stages/pack.py call; None: the numpy path


def name() -> str:
    """``"compiled"`` or ``"numpy"``: the path the hot loops take in this process."""
    return "compiled" if ext is not None else "numpy"
