"""The "mp" executor: tensor-parallel ranks as worker processes this engine starts on one node.

Rank 0 is the driver: the engine's own process, which holds the scheduler and the KV manager and
runs its shard of the model like any rank. Ranks 1..N-1 are spawned processes
(torch.multiprocessing, "spawn": a fork of a process that already started torch's threads is
unsafe). Each step the driver broadcasts the SchedulerOutput (torch.distributed's
broadcast_object_list) and every rank runs the same ModelRunner.execute on it: the same state
updates, block copies, batch tensors and sampling, so the layers' collectives line up rank for
rank. Only the driver's ModelRunnerOutput is used; the others' samples equal it (same logits,
same per-sequence generators).

A worker that dies is reported by its exit code before the next step (and any collective that
was waiting on it fails: gloo sees the closed connection, or the collective timeout fires); the
engine then refuses every further step with the same error.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
import weakref
from typing import Any

import torch
import torch.multiprocessing as mp

from pagedllm.config import EngineConfig
from pagedllm.parallel.group import TensorParallelGroup
from pagedllm.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("pagedllm")

# How long a clean shutdown waits for a worker to leave its loop before killing it.
_JOIN_TIMEOUT_S = 10.0


class TensorParallelWorkerError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot step any more."""


def threads_per_rank(config: EngineConfig) -> int:
    """Intra-op threads of each rank: ``num_threads`` if given, else the CPUs this process may
    use split evenly over the ranks (oversubscribed ranks slow each other's collectives down)."""
    if config.num_threads:
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


def _rank_cpus(rank: int, world_size: int) -> set[int] | None:
    """The CPUs a worker rank is pinned to: its even slice of this process's set, or None when
    there are fewer CPUs than ranks (no slice of its own to pin to)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // world_size
    return set(cpus[rank * per : (rank + 1) * per]) if per else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    """The driver's side: the worker processes and rank 0's process group."""

    def __init__(self, config: EngineConfig, procs: list, tp: TensorParallelGroup) -> None:
        self.config = config
        self.procs = procs
        self.tp = tp
        self.failure: TensorParallelWorkerError | None = None
        # An engine dropped without shutdown() still stops its workers and leaves the group.
        self._finalizer = weakref.finalize(self, _release, procs, tp)

    @classmethod
    def start(cls, config: EngineConfig) -> MultiprocExecutor:
        """Spawns ranks 1..N-1 (they load their shards at once) and joins the group as rank 0."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine is already running in this process (its process group is "
                "the default one): shut it down first (runner.shutdown()) or run the other in its own process."
            )
        world = config.tensor_parallel_size
        port = _free_port()
        ctx = mp.get_context("spawn")
        procs = []
        for rank in range(1, world):
            p = ctx.Process(target=worker_main, args=(config, rank, port), name=f"pagedllm-tp{rank}", daemon=True)
            p.start()
            procs.append(p)
        torch.set_num_threads(threads_per_rank(config))
        try:
            tp = TensorParallelGroup(0, world, port)
        except BaseException:
            _stop_processes(procs)
            raise
        logger.info("pagedllm: tensor parallel x%d, workers %s", world, [p.pid for p in procs])
        return cls(config, procs, tp)

    def start_steps(self, runner, num_kv_blocks: int, num_swap_blocks: int) -> TensorParallelRunner:
        """Tells the workers the KV cache size the driver chose (each allocates as many blocks of
        its own KV heads); the runner the engine steps from here on."""
        self.check_workers()
        self.tp.broadcast_object((num_kv_blocks, num_swap_blocks))
        return TensorParallelRunner(runner, self)

    def check_workers(self) -> None:
        """Raises TensorParallelWorkerError if a worker has exited (or did before)."""
        if self.failure is not None:
            raise self.failure
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                self.failure = TensorParallelWorkerError(
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}; "
                    "the engine cannot run further steps and must be restarted."
                )
                raise self.failure

    def fail(self, cause: BaseException) -> TensorParallelWorkerError:
        """The error of a step whose collective failed: the dead worker's exit if one exited
        (polled briefly: its exit may lag the closed connection), else the collective's own."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self.check_workers()
            except TensorParallelWorkerError as e:
                return e
            time.sleep(0.05)
        self.failure = TensorParallelWorkerError(
            f"a tensor-parallel collective failed ({type(cause).__name__}: {cause}); "
            "the engine cannot run further steps and must be restarted."
        )
        return self.failure

    def shutdown(self, graceful: bool = True) -> None:
        """Stops the workers: the stop message (None) when they are all waiting for a step, else
        (or after _JOIN_TIMEOUT_S) terminate. The process group goes with them."""
        if graceful and self.failure is None and all(p.is_alive() for p in self.procs):
            try:
                self.tp.broadcast_object(None)
            except Exception:  # a worker went away meanwhile: terminate below
                pass
            for p in self.procs:
                p.join(_JOIN_TIMEOUT_S)
        self._finalizer.detach()
        _release(self.procs, self.tp)


def _release(procs: list, tp: TensorParallelGroup) -> None:
    _stop_processes(procs)
    tp.destroy()


def _stop_processes(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(_JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()


class TensorParallelRunner:
    """The engine's runner under tensor parallelism: broadcasts each step, then runs rank 0's.
    Other attributes are the driver's ModelRunner's (states, block tables, model)."""

    def __init__(self, runner, executor: MultiprocExecutor) -> None:
        self.local = runner
        self.executor = executor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        ex = self.executor
        ex.check_workers()
        try:
            ex.tp.broadcast_object(sched)
            return self.local.execute(sched)
        except TensorParallelWorkerError:
            raise
        except RuntimeError as e:
            # gloo reports a lost peer as a RuntimeError (closed connection, timeout); other
            # errors of the step itself (a bad state) raise unchanged on every rank alike.
            if _is_collective_failure(e):
                raise ex.fail(e) from e
            raise

    def shutdown(self) -> None:
        self.executor.shutdown()


def _is_collective_failure(e: BaseException) -> bool:
    """torch.distributed's own error types, or gloo's plain RuntimeErrors about its connections."""
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(
        needle in text for needle in ("gloo", "connection", "timed out", "timeout", "peer", "broken pipe", "socket")
    )


def worker_main(config: EngineConfig, rank: int, port: int) -> None:
    """A worker rank: load the shard, allocate the KV cache the driver sized, run every step the
    driver broadcasts until it broadcasts None."""
    from pagedllm.engine.builder import build_runner, load_engine_model

    cpus = _rank_cpus(rank, config.tensor_parallel_size)
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads_per_rank(config))
    tp = TensorParallelGroup(rank, config.tensor_parallel_size, port)
    try:
        loaded = load_engine_model(config, tp)
        num_kv_blocks, num_swap_blocks = tp.broadcast_object()
        runner = build_runner(config, loaded, num_kv_blocks, num_swap_blocks)
        while (sched := tp.broadcast_object()) is not None:
            try:
                runner.execute(sched)
            except Exception:
                # A step that raises here raises on the driver too (the same inputs, the same
                # code), which then retries or fails its requests: keep serving. A lost driver
                # fails the next broadcast, outside this handler.
                logger.exception("pagedllm: tensor-parallel rank %d: step failed", rank)
    except BaseException:
        # The driver sees this rank's exit code (and its collectives fail); the cause is here.
        traceback.print_exc()
        os._exit(1)
    tp.destroy()
