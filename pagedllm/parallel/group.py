"""The tensor-parallel process group of one rank, and the collectives the model's layers call.

Two gloo groups over the same ranks: the model's collectives (all-reduce, all-gather) run with a
bounded timeout, so a rank that stops answering inside a step surfaces as an error, not a hang;
the step broadcast (the driver's SchedulerOutput) waits as long as the engine stays idle, so it
runs on a group without a practical timeout.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective inside a step that takes longer than this means a rank is gone or stuck.
COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("PAGEDLLM_TP_COLLECTIVE_TIMEOUT_S", "120")))
# Workers wait for the next step for as long as the engine has nothing to run.
IDLE_TIMEOUT = timedelta(days=365)
# Start-up: every rank imports torch and loads its shard before the first broadcast.
RENDEZVOUS_TIMEOUT = timedelta(seconds=float(os.environ.get("PAGEDLLM_TP_RENDEZVOUS_TIMEOUT_S", "600")))


class TensorParallelGroup:
    """This process's rank among ``world_size`` ranks, and the collectives of the sharded layers.

    ``comm_seconds``: wall time spent inside the model's collectives since the last reset (the
    step-time split of docs/scaling.md); two clock reads per collective.
    """

    def __init__(self, rank: int, world_size: int, port: int, host: str = "127.0.0.1") -> None:
        """``host``:``port``: the rendezvous (a TCP store rank 0 serves); 127.0.0.1 when every rank
        runs on this node, the driver node's address when ranks run on others (the Ray executor).
        Gloo's own connections use the interface GLOO_SOCKET_IFNAME names, else the one this
        host's name resolves to."""
        self.rank, self.world_size = rank, world_size
        # The default group carries the step broadcast (no practical timeout: an idle engine).
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=max(IDLE_TIMEOUT, RENDEZVOUS_TIMEOUT),
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for the rendezvous rank 0 serves ("" checks every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
