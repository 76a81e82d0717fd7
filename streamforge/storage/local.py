"""Reads of this machine's files without fsspec.

A reader needs three calls of a filesystem: ``cat_file`` (whole, or a byte range), ``size``
and ``exists``. For local paths ``LocalReader`` makes them with ``open`` and ``os``, so a pass
over local shards never imports fsspec, nor the codecs and asyncio it loads, and spares their
memory and start-up (docs/storage.md gives both). Writers, the ledger and conversion keep fsspec.
"""

from __future__ import annotations

import os
import stat

from ..errors import ShardCorruptError
from .urls import without_scheme

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class LocalReader:
    """``cat_file``, ``size`` and ``exists`` on local paths, as fsspec's local filesystem.

    Only regular files are read: a FIFO would block the reader forever and ``/dev/zero`` would
    fill memory, so anything else raises ``ShardCorruptError`` naming the path and what it is.
    The file is opened without blocking (a FIFO's ``open`` waits for a writer) and checked
    with ``fstat`` on the open descriptor, so a swap between the check and the read is caught.
    """

    protocol = "file"

    @staticmethod
    def _strip_protocol(url: str) -> str:
        return os.path.abspath(without_scheme(url, "file", "local"))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if (start is None) != (end is None):
            raise ValueError("cat_file takes both start and end, or neither")
        if start is not None and (start < 0 or end < start):
            raise ValueError(f"{path}: bytes {start}..{end} are not a range of a file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
                raise ShardCorruptError(f"{path}: is {kind}, not a regular file; streamforge reads only regular files")
            if start is None:
                return f.read()
            f.seek(start)
            return f.read(end - start)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(path)


LOCAL_READER = LocalReader()
