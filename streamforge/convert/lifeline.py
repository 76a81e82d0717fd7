"""Converter worker processes that die with their parent.

A pool worker writes shard files straight to the output. When the coordinator is killed
(SIGKILL runs no handler and no ``atexit``), nothing tells a worker: it would finish the tasks
already queued to it, writing shards nobody will list, then wait on its queue forever.
``die_with_parent`` is the pool initializer that prevents this, with two guards:

1. Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, so the kernel kills the worker as its parent
   goes. The signal follows the *thread* that forked the worker; a pool forks its workers
   from the thread that submits the first task, and the converters shut their pools down
   before that call returns, so the thread outlives its workers.
2. Everywhere (and as a second line on Linux): a daemon thread that checks ``os.getppid()``
   every ``POLL_SECONDS`` and ends the process once the worker has been re-parented.

Either way a killed coordinator's workers are gone within ``POLL_SECONDS``; what they were
writing is a shard under a name no manifest lists, removed by the next conversion.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from multiprocessing import get_context
import threading
import time

POLL_SECONDS = 0.2
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
EXIT_ORPHANED = 70


def die_with_parent(parent_pid: int) -> None:
    """Pool initializer: end this process when ``parent_pid`` (its parent) ends."""
    if sys.platform.startswith("linux"):
        _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the guards were set
        os._exit(EXIT_ORPHANED)
    watcher = threading.Thread(
        target=_watch, args=(parent_pid,), name="streamforge-parent-watch", daemon=True
    )
    watcher.start()


def _set_parent_death_signal() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the watcher thread alone guards
        pass


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_SECONDS)
    os._exit(EXIT_ORPHANED)


def pool_context():
    """fork where available: a spawned worker re-imports ``streamforge`` (and torch with it),
    seconds per worker. Forking is safe here: workers touch no torch state, and fsspec
    resets its event loop and instance cache in a forked child."""
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    return get_context(method)
