"""Launch a worker script under ``torchrun`` on this machine, as the multi-process tests do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .s3_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: Path, *args: object, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """``script args...`` on ``nproc`` processes (127.0.0.1, a free port, no GPU, the repository
    and tests/ importable); asserts it exited 0, showing the end of its stderr if not."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc
