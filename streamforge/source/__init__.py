"""Reading streams: storage fetches, format decodes, and this package joins the two.

``ShardSource`` (``shard_source.py``) is the random-access view of one stream: it plans the
reads, drives ``storage/`` (ranged reads with retries, the frame cache, and the prefetch
threads through ``readahead.py``), hands the bytes to ``format/`` to decode, and applies the
integrity checks and the skip policy. ``read_records`` (``records.py``) reads one shard's
records by URL.
"""

from .records import read_records
from .shard_source import ShardSource

__all__ = ["ShardSource", "read_records"]
