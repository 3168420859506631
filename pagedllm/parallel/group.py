"""The tensor-parallel process group of one rank, and the collectives the model's layers call.

Two gloo groups over the same ranks: the model's collectives (all-reduce, all-gather) run with a
bounded timeout, so a rank that stops answering inside a step surfaces as an error, not a hang;
the step broadcast (the driver's SchedulerOutput) waits as long as the engine stays idle, so it
runs on a group without a practical timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm.parallel.rendezvous import DriverRendezvous, Rendezvous, gloo_interface

# A collective inside a step that takes longer than this means a rank is gone or stuck.
COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("PAGEDLLM_TP_COLLECTIVE_TIMEOUT_S", "120")))
# Workers wait for the next step for as long as the engine has nothing to run.
IDLE_TIMEOUT = timedelta(days=365)
# Start-up: every rank imports torch and loads its shard before the first broadcast.
RENDEZVOUS_TIMEOUT = timedelta(seconds=float(os.environ.get("PAGEDLLM_TP_RENDEZVOUS_TIMEOUT_S", "600")))
# How often the driver, waiting for the workers to join, checks that none of them died meanwhile.
_JOIN_POLL = timedelta(seconds=0.25)


class TensorParallelWorkerError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot step any more."""


class TensorParallelGroup:
    """This process's rank among ``world_size`` ranks, and the collectives of the sharded layers.

    ``comm_seconds``: wall time spent inside the model's collectives since the last reset (the
    step-time split of docs/scaling.md); two clock reads per collective.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        rendezvous: Rendezvous | DriverRendezvous,
        dead_worker: Callable[[], str | None] | None = None,
    ) -> None:
        """``rendezvous``: where the ranks meet and the interface gloo binds (rendezvous.py);
        rank 0 (the driver) serves it, so it passes the DriverRendezvous, the workers its spec.
        ``dead_worker`` (rank 0): what happened to a worker that is gone, or None; the driver
        checks it while it waits for the workers to join."""
        self.rank, self.world_size = rank, world_size
        store = _rendezvous(rank, world_size, rendezvous, dead_worker)
        interface = rendezvous.spec.interface if isinstance(rendezvous, DriverRendezvous) else rendezvous.interface
        with gloo_interface(interface):
            # The default group carries the step broadcast (no practical timeout: an idle engine).
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=max(IDLE_TIMEOUT, RENDEZVOUS_TIMEOUT)
            )
            self.model_group = dist.new_group(list(range(world_size)), timeout=COLLECTIVE_TIMEOUT, backend="gloo")
        self.comm_seconds = 0.0
        self.num_collectives = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` (contiguous) over the ranks in place; returns it."""
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.model_group)
        self._count(t0)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on each), in rank order."""
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.model_group)
        self._count(t0)
        return parts

    def _count(self, t0: float) -> None:
        self.comm_seconds += time.perf_counter() - t0
        self.num_collectives += 1

    def broadcast_object(self, obj: object = None) -> object:
        """The driver's (rank 0's) ``obj`` on every rank (pickled through the default group)."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rendezvous(
    rank: int,
    world_size: int,
    rendezvous: Rendezvous | DriverRendezvous,
    dead_worker: Callable[[], str | None] | None,
) -> dist.Store:
    """The store every rank joins through. Rank 0 serves it and waits for each worker's
    "joined" key in short slices, checking ``dead_worker`` in between: a worker that dies before it
    joins (a crash at import, a script that starts an engine at import under "spawn") fails the
    start at once instead of after RENDEZVOUS_TIMEOUT."""
    if rank != 0:
        assert isinstance(rendezvous, Rendezvous)
        store = rendezvous.join(world_size, RENDEZVOUS_TIMEOUT)
        store.set(f"pagedllm/joined/{rank}", "1")
        return store
    assert isinstance(rendezvous, DriverRendezvous), "rank 0 serves the rendezvous"
    store = rendezvous.serve(world_size, RENDEZVOUS_TIMEOUT)
    keys = [f"pagedllm/joined/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    # check() does not block (a FileStore's wait() with a timeout raises a bare RuntimeError).
    while not store.check(keys):
        dead = dead_worker() if dead_worker is not None else None
        if dead is not None:
            raise TensorParallelWorkerError(f"{dead} before it joined the tensor-parallel group")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"tensor-parallel workers did not join within {RENDEZVOUS_TIMEOUT.total_seconds():g}s "
                "(PAGEDLLM_TP_RENDEZVOUS_TIMEOUT_S)"
            )
        time.sleep(_JOIN_POLL.total_seconds())
    return store
