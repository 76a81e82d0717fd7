"""Converters from existing token corpora to streams: one source format per module.

``convert(fmt, input, output, ...)`` validates the whole source, places every shard boundary
from the document lengths, writes shards in parallel and the manifest last. See
``docs/convert.md``.
"""

from .base import ArraySource
from .run import FORMATS, convert, open_source

__all__ = sorted(["ArraySource", "FORMATS", "convert", "open_source"])
