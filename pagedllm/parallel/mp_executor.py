"""The "mp" executor: tensor-parallel ranks 1..N-1 as worker processes this engine starts on one
node (torch.multiprocessing, "spawn": a fork of a process that already started torch's threads is
unsafe). The step loop and the driver's runner are parallel/worker.py's; a worker's death shows
as its exit code.
"""

from __future__ import annotations

import logging
import os
import traceback
import weakref

import torch
import torch.multiprocessing as mp

from pagedllm.config import EngineConfig
from pagedllm.parallel.group import TensorParallelGroup
from pagedllm.parallel.rendezvous import DriverRendezvous, Rendezvous
from pagedllm.parallel.worker import (
    JOIN_TIMEOUT_S,
    TensorParallelExecutor,
    TensorParallelWorkerError,
    run_rank,
    threads_per_rank,
)

__all__ = ["MultiprocExecutor", "TensorParallelWorkerError", "worker_main"]

logger = logging.getLogger("pagedllm")


def _rank_cpus(rank: int, world_size: int) -> set[int] | None:
    """The CPUs a worker rank is pinned to: its even slice of this process's set, or None when
    there are fewer CPUs than ranks (no slice of its own to pin to)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // world_size
    return set(cpus[rank * per : (rank + 1) * per]) if per else None


class MultiprocExecutor(TensorParallelExecutor):
    """The driver's side: the worker processes and rank 0's process group."""

    def __init__(
        self, config: EngineConfig, procs: list, tp: TensorParallelGroup, rendezvous: DriverRendezvous
    ) -> None:
        super().__init__(config, tp)
        self.procs = procs
        self.rendezvous = rendezvous
        self._finalizer = weakref.finalize(self, _release, procs, tp, rendezvous)

    @classmethod
    def start(cls, config: EngineConfig) -> MultiprocExecutor:
        """Spawns ranks 1..N-1 (they load their shards at once) and joins the group as rank 0."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine is already running in this process (its process group is "
                "the default one): shut it down first (LLM.shutdown()) or run the other in its own process."
            )
        world = config.tensor_parallel_size
        # Every rank is on this node: a FileStore in a private directory, gloo on loopback.
        rendezvous = DriverRendezvous.on_this_node()
        ctx = mp.get_context("spawn")
        procs = []
        try:
            for rank in range(1, world):
                p = ctx.Process(
                    target=worker_main, args=(config, rank, rendezvous.spec), name=f"pagedllm-tp{rank}", daemon=True
                )
                p.start()
                procs.append(p)
            torch.set_num_threads(threads_per_rank(config))
            tp = TensorParallelGroup(0, world, rendezvous, dead_worker=lambda: _dead_process(procs))
        except TensorParallelWorkerError as e:
            _stop_processes(procs)
            rendezvous.close()
            raise TensorParallelWorkerError(
                f"{e}: its stderr says why. Under the 'spawn' start method each worker imports the "
                'main module again: a script must start engines under `if __name__ == "__main__":`.'
            ) from None
        except BaseException:
            _stop_processes(procs)
            rendezvous.close()
            raise
        logger.info("pagedllm: tensor parallel x%d, workers %s", world, [p.pid for p in procs])
        return cls(config, procs, tp, rendezvous)

    def _dead_worker(self) -> str | None:
        return _dead_process(self.procs)

    def _wait_workers_exit(self, timeout: float) -> None:
        for p in self.procs:
            p.join(timeout)


def _dead_process(procs: list) -> str | None:
    """The first worker process that has exited (rank 1 first), or None."""
    for rank, p in enumerate(procs, start=1):
        if not p.is_alive():
            return f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
    return None


def _release(procs: list, tp: TensorParallelGroup, rendezvous: DriverRendezvous) -> None:
    _stop_processes(procs)
    tp.destroy()
    rendezvous.close()


def _stop_processes(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()


def worker_main(config: EngineConfig, rank: int, rendezvous: Rendezvous) -> None:
    """A spawned worker rank: pinned to its slice of the CPUs, runs run_rank; any failure exits
    the process (the driver sees the exit code, and its collectives fail)."""
    cpus = _rank_cpus(rank, config.tensor_parallel_size)
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads_per_rank(config))
    try:
        run_rank(config, rank, rendezvous)
    except BaseException:
        traceback.print_exc()  # the cause, in the worker's stderr
        os._exit(1)
