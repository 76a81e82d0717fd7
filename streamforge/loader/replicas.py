"""One read per replica group (``StreamingLoader(read_once=True)``).

In a hybrid-parallel job the processes of one model-parallel group (tensor, context or
pipeline parallel peers) share a data-parallel rank and get the same batches. With
``read_once``, replica 0 of each group runs the pipelines (its worker processes read, decode
and pack) and broadcasts every compact batch (``RowBatch``, about 2 bytes a token) with the
state that came with it over the replica group; the other replicas read nothing from storage
and receive it. Every replica then expands, pins and copies the batch itself, for its own
``fields`` (a pipeline stage may ask for the inputs only), and commits the same state, so
``state_dict()`` is the same on each of them.

The hand-over is one broadcast a step, on the training thread: the loader takes each batch
synchronously (``device_prefetch`` is not used), so that every replica enters the same
broadcasts in the same order and a loop that stops early leaves no replica waiting. The
reading itself still runs ahead in replica 0's worker processes.

A failure while replica 0 builds a batch is sent in the batch's place and raised on every
replica, rather than leaving them waiting until the collective times out.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from ..errors import ConfigError, PipelineInvariantError
from ..topology import Topology
from .workers import WorkerBatch


def check_replicas(topology: Topology, **settings: Any) -> None:
    """Replicas must make the same batches: their ``settings`` (the data settings'
    fingerprint, ``read_once``, ``skip_steps``) are compared (one all-gather over the replica
    group), and a difference is raised on each of them, naming it."""
    if topology.replicas == 1:
        return
    every = topology.gather_replicas(settings)
    for key in settings:
        values = [v[key] for v in every]
        if any(v != values[0] for v in values):
            what = "the data settings (dataset and batch size)" if key == "fingerprint" else key
            raise ConfigError(
                f"the {topology.replicas} replicas of data-parallel rank {topology.rank} differ in {what}: "
                f"{values} by replica; replicas must get the same batches")


class _Failed:
    """Sent in place of a batch that replica 0 could not build."""

    def __init__(self, error: BaseException) -> None:
        self.text = f"{type(error).__name__}: {error}"


def send_to_replicas(items: Iterator[WorkerBatch], topology: Topology,
                     skipped_after: Callable[[WorkerBatch], list]) -> Iterator[WorkerBatch]:
    """``items`` as built here (replica 0), each broadcast to the other replicas first, with
    the damaged records skipped once it is handed out (``skipped_after``); storage counters
    stay here."""
    try:
        for item in items:
            topology.broadcast_to_replicas(
                (WorkerBatch(item.logical, item.step, item.rows, item.state), skipped_after(item)))
            yield item
    except Exception as exc:
        topology.broadcast_to_replicas(_Failed(exc))
        raise
    finally:
        items.close()


def receive_from_replica_zero(topology: Topology, steps: int | None,
                              on_skipped: Callable[[list], None]) -> Iterator[WorkerBatch]:
    """The batches replica 0 builds: ``steps`` of them (None: without end); the damaged
    records replica 0 skipped go to ``on_skipped``."""
    while steps is None or steps > 0:
        got: Any = topology.broadcast_to_replicas(None)
        if isinstance(got, _Failed):
            raise PipelineInvariantError(
                f"replica 0 of data-parallel rank {topology.rank} (process "
                f"{topology.groups.replica_ranks[0]}) could not build the next batch: {got.text}")
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], WorkerBatch)):
            raise PipelineInvariantError(f"read_once: replica 0 sent {type(got).__name__}, not a batch")
        steps = None if steps is None else steps - 1
        on_skipped(got[1])
        yield got[0]
