"""Builds streamforge's compiled core, ``streamforge.pipeline._core`` (the per-batch hot loops,
streamforge/pipeline/_core.c, plain C on the buffer protocol: no numpy headers needed). The
package's metadata lives in pyproject.toml.

The extension is optional: where it does not compile (no C compiler), the install goes on
without it and streamforge runs its numpy path, which gives the same batches
(``streamforge.pipeline.core``; ``StreamingLoader.stats()["core"]`` says which runs). With
``STREAMFORGE_EXT_REQUIRED=1`` (``make test``), a failed build fails: the tests never run on a
copy left in build/ by an earlier build.
"""

import os

from setuptools import Extension, setup

optional = os.environ.get("STREAMFORGE_EXT_REQUIRED", "") in ("", "0")

setup(
    ext_modules=[
        Extension("streamforge.pipeline._core", ["streamforge/pipeline/_core.c", "streamforge/pipeline/_layout.c"], optional=optional),
    ],
)
