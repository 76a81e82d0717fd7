"""Converters to streams: from token corpora (one source format per module) and from raw text.

``convert(fmt, input, output, ...)`` validates the whole source, places every shard boundary
from the document lengths, writes shards in parallel and the manifest last. With
``text_field=`` and ``tokenizer=`` it tokenizes jsonl/parquet text instead, on local processes
or Ray (``textrun``). See ``docs/convert.md``.
"""

from .base import ArraySource
from .run import FORMATS, convert, open_source

__all__ = sorted(["ArraySource", "FORMATS", "convert", "open_source"])
