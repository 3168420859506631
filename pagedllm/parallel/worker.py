"""What every tensor-parallel executor shares: a worker rank's step loop, the driver's runner that
broadcasts each step, and how a failed step is told apart from a lost rank.

An executor ("mp": processes, "ray": Ray actors) only decides how ranks 1..N-1 start and how
their death is noticed (``TensorParallelExecutor._dead_worker`` / ``_wait_workers_exit`` /
``_finalizer``). Rank 0 is always the driver: the engine's own process, which holds the scheduler
and the KV manager and runs its shard of the model like any rank. Each step the driver
broadcasts the SchedulerOutput (torch.distributed's broadcast_object_list) and every rank runs
the same ModelRunner.execute on it: the same state updates, block copies, batch tensors and
sampling, so the layers' collectives line up rank for rank. Only the driver's ModelRunnerOutput is
used; the others' samples equal it (same logits, same per-sequence generators).

A dead worker is reported before the next step (and any collective that was waiting on it fails:
gloo sees the closed connection, or the collective timeout fires); the engine then refuses every
further step with the same error.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.parallel.group import TensorParallelGroup, TensorParallelWorkerError
from pagedllm.parallel.rendezvous import Rendezvous
from pagedllm.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("pagedllm")

# How long a clean shutdown waits for the workers to leave their loops before killing them.
JOIN_TIMEOUT_S = 10.0


def threads_per_rank(config: EngineConfig) -> int:
    """Intra-op threads of each rank: ``num_threads`` if given, else the CPUs this process may
    use split evenly over the ranks (oversubscribed ranks slow each other's collectives down)."""
    if config.num_threads:
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


def run_rank(config: EngineConfig, rank: int, rendezvous: Rendezvous) -> None:
    """A worker rank: join the group, load the shard, allocate the KV cache the driver sized, run
    every step the driver broadcasts until it broadcasts None. Raises what stops it otherwise
    (its executor reports that to the driver)."""
    from pagedllm.engine.builder import build_runner, load_engine_model

    tp = TensorParallelGroup(rank, config.tensor_parallel_size, rendezvous)
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
    tp.destroy()


class TensorParallelExecutor:
    """The driver's side of an executor: rank 0's process group and the workers' liveness.

    Subclasses start the workers, set ``_finalizer`` (a weakref.finalize that stops them and
    leaves the group: an executor dropped without shutdown() still cleans up) and say how a dead
    worker shows (``_dead_worker``) and how to wait for the workers to leave (``_wait_workers_exit``).
    """

    # How long a failed collective waits for the executor to see which worker died: its death
    # may be reported after the closed connection that failed the collective.
    death_report_wait_s = 2.0
    _finalizer: weakref.finalize

    def __init__(self, config: EngineConfig, tp: TensorParallelGroup) -> None:
        self.config = config
        self.tp = tp
        self.failure: TensorParallelWorkerError | None = None
        self.is_shut_down = False

    def _dead_worker(self) -> str | None:
        """What happened to the first worker that is gone (rank, how it went), or None."""
        raise NotImplementedError

    def _wait_workers_exit(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for every worker to leave its loop (after the stop message)."""
        raise NotImplementedError

    def start_steps(self, runner, num_kv_blocks: int, num_swap_blocks: int) -> TensorParallelRunner:
        """Tells the workers the KV cache size the driver chose (each allocates as many blocks of
        its own KV heads); the runner the engine steps from here on."""
        self.check_workers()
        self.tp.broadcast_object((num_kv_blocks, num_swap_blocks))
        return TensorParallelRunner(runner, self)

    def check_workers(self) -> None:
        """Raises TensorParallelWorkerError if a worker is gone (or was before)."""
        if self.failure is not None:
            raise self.failure
        dead = self._dead_worker()
        if dead is not None:
            self.failure = TensorParallelWorkerError(
                f"{dead}; the engine cannot run further steps and must be restarted."
            )
            raise self.failure

    def fail(self, cause: BaseException) -> TensorParallelWorkerError:
        """The error of a step whose collective failed: the dead worker's if one is seen dead
        within death_report_wait_s, else the collective's own."""
        deadline = time.monotonic() + self.death_report_wait_s
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
        """Stops the workers (idempotent): the stop message (None) when they are all waiting for
        a step, else (or after JOIN_TIMEOUT_S) they are killed. The process group goes with them.

        ``graceful=False`` when a step may be in flight on another thread (a stop message would
        interleave with its collectives): the workers are killed, and that step fails."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        if graceful and self.failure is None and self._dead_worker() is None:
            try:
                self.tp.broadcast_object(None)
                self._wait_workers_exit(JOIN_TIMEOUT_S)
            except Exception:  # a worker went away meanwhile: killed below
                pass
        self._finalizer()
        if self.failure is None:
            self.failure = TensorParallelWorkerError("the tensor-parallel engine was shut down.")


class TensorParallelRunner:
    """The engine's runner under tensor parallelism: broadcasts each step, then runs rank 0's.
    Other attributes are the driver's ModelRunner's (states, block tables, model)."""

    def __init__(self, runner, executor: TensorParallelExecutor) -> None:
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
            if is_collective_failure(e):
                raise ex.fail(e) from e
            raise

    def shutdown(self, graceful: bool = True) -> None:
        self.executor.shutdown(graceful)


def is_collective_failure(e: BaseException) -> bool:
    """torch.distributed's own error types, or gloo's plain RuntimeErrors about its connections."""
    import torch.distributed as dist

    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(
        needle in text for needle in ("gloo", "connection", "timed out", "timeout", "peer", "broken pipe", "socket")
    )
