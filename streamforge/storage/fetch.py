"""Ranged reads of shard bytes.

``ByteFetcher`` is the one door through which shard bytes enter streamforge: every read is a
``(name, start, stop)`` byte range of a file under the stream's URL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .open import join, open_url


@dataclass
class FetchStats:
    requests: int = 0
    bytes_fetched: int = 0
    retries: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class ByteFetcher:
    """Fetch byte ranges of the files of one stream prefix; picklable, opens lazily."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = str(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.stats = FetchStats()
        self._fs = None
        self._path = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fs"] = None
        state["stats"] = FetchStats()
        return state

    def _open(self):
        if self._fs is None:
            self._fs, self._path = open_url(self.url, self.storage_options)
        return self._fs, self._path

    def read(self, name: str, start: int, stop: int) -> bytes:
        fs, path = self._open()
        data = fs.cat_file(join(path, name), start=start, end=stop)
        self.stats.requests += 1
        self.stats.bytes_fetched += len(data)
        return data
