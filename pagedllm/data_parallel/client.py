"""DataParallelClient: N engine replicas (Ray actors) behind one server, as one EngineClient.

Ray gives both "processes on this node" and "actors across nodes" from one code path: with
RAY_ADDRESS set the server joins that cluster and the replicas land wherever it has CPUs; else it
starts a local cluster of this machine's CPUs bound to loopback (parallel/ray_cluster.py) and
stops it on shutdown. Each replica reserves
``num_threads`` CPUs (by default the cluster's CPUs / N) and runs that many torch threads.

Requests: the router (router.py) picks a replica from the prompt's token ids; the replica's
streaming generator (replica.py) carries the outputs back. The front end holds no weights: it
takes the model facts from the first replica and loads only the tokenizer.

Failures: a replica whose actor dies (process killed, node lost) fails the requests it was
running with RequestFailedError (the server answers 500 / an error event) and is marked dead, so
the router stops sending to it; a request refused by a dead replica before it started is routed
again to a live one. /health is 503 only once no replica is left (the server then exits, as the
single-engine server does when its engine thread dies).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.data_parallel.replica import EngineReplica
from pagedllm.data_parallel.router import NoReplicaError, Router
from pagedllm.engine.client import ModelFacts
from pagedllm.engine.intake import PromptType
from pagedllm.engine.request_stream import EngineDeadError, RequestFailedError
from pagedllm.outputs import RequestOutput
from pagedllm.parallel.ray_cluster import connect_ray
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger("pagedllm.data_parallel")

START_TIMEOUT_S = float(os.environ.get("PAGEDLLM_DP_START_TIMEOUT_S", "600"))  # model load + CPU reservation
HEALTH_TIMEOUT_S = 10.0
# Counters that add up over replicas in the aggregate /stats; the rest are per replica only.
_SUMMED = (
    "num_requests_running",
    "num_requests_waiting",
    "num_kv_blocks",
    "num_free_kv_blocks",
    "kv_slots_total",
    "kv_cache_bytes",
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prompt_tokens",
    "generation_tokens",
    "num_step_errors",
)


class _ReplicaDied(Exception):
    pass


class ReplicaStream:
    """One request's outputs from a replica's streaming generator (an OutputStream).

    Releases the request's load in the router exactly once, however it ends.
    """

    def __init__(self, client: DataParallelClient, replica: int, request_id: str, generator: Any) -> None:
        self.request_id = request_id
        self.replica = replica
        self.finished = False
        self._client = client
        self._gen = generator
        self._closed = False
        self._released = False
        self._last_token_time: float | None = None

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._client.router.release(self.replica)

    async def _next_item(self) -> Any:
        import ray

        try:
            ref = await self._gen.__anext__()
            return await ref
        except StopAsyncIteration:
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self._client._replica_died(self.replica, e)
            raise _ReplicaDied from e

    async def accepted(self) -> None:
        """Waits for the replica's first item: raises the error that refused the request."""
        try:
            item = await self._next_item()
        except BaseException:
            self._end()
            raise
        if item is not None:
            self._end()
            raise item

    def _end(self) -> None:
        self.finished = True
        self._closed = True
        self._release()

    def abort(self) -> None:
        if not self.finished:
            self._client._abort_on(self.replica, [self.request_id])
        self._end()

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            item = await self._next_item()
        except StopAsyncIteration:
            self._end()
            raise
        except _ReplicaDied as e:
            self._end()
            raise RequestFailedError(
                f"Data-parallel replica {self.replica} died while running this request."
            ) from e.__cause__
        except BaseException:
            if not self._closed:
                self.abort()
            raise
        if self._closed:  # aborted while waiting
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._end()
            raise item
        hook = self._client.output_hook
        if hook is not None:
            try:
                hook(item, self._last_token_time)
            except Exception:  # metrics must never break serving
                logger.exception("output hook failed")
            self._last_token_time = item.metrics.get("last_token_time", self._last_token_time)
        if item.finished:
            self._end()
        return item


class DataParallelClient:
    """An EngineClient over replica actors; build it with ``launch``."""

    def __init__(self, actors: list[Any], facts: ModelFacts, routing: str, owns_cluster: bool) -> None:
        self.actors = actors
        self.facts = facts
        self.router = Router(len(actors), facts.block_size, policy=routing)
        self._owns_cluster = owns_cluster
        tok = load_tokenizer(facts.tokenizer_path)
        tok.chat_template = facts.chat_template  # the replicas' (the engine argument may replace the model's)
        self.tokenizer = tok
        self.output_hook: Callable[[RequestOutput, float | None], None] | None = None
        self.on_dead: Callable[[BaseException], None] | None = None
        self.max_step_failures = 3  # the replicas' (launch passes it on)
        self._last_error: dict[int, str] = {}

    @property
    def size(self) -> int:
        return len(self.actors)

    @classmethod
    def launch(
        cls,
        config: EngineConfig,
        data_parallel_size: int,
        routing: str = "prefix",
        max_step_failures: int = 3,
    ) -> DataParallelClient:
        """Starts (or joins, with RAY_ADDRESS) a Ray cluster and ``data_parallel_size`` replicas;
        returns once every replica has loaded the model."""
        check_data_parallel(config, data_parallel_size)
        try:
            # Before anything imports ray: a local cluster's loopback binding is set at its import.
            # RAY_ADDRESS's cluster, else a local one of this machine's CPUs.
            owns = connect_ray(num_cpus=os.cpu_count()) == "started"
        except ImportError as e:
            raise ValueError("data_parallel_size > 1 needs Ray: pip install ray") from e
        import ray

        try:
            cpus = int(ray.cluster_resources().get("CPU", 1))
            threads = config.num_threads or max(1, cpus // data_parallel_size)
            replica_config = dataclasses.replace(config, num_threads=threads)
            actor_cls = ray.remote(EngineReplica)
            actors = [
                actor_cls.options(num_cpus=threads, max_concurrency=10_000).remote(replica_config, i, max_step_failures)
                for i in range(data_parallel_size)
            ]
            logger.info("starting %d replicas of %d thread(s) each", data_parallel_size, threads)
            try:
                facts = ray.get([a.facts.remote() for a in actors], timeout=START_TIMEOUT_S)[0]
            except ray.exceptions.GetTimeoutError as e:
                raise ValueError(
                    f"the {data_parallel_size} replicas did not start within {START_TIMEOUT_S:.0f} s: does the "
                    f"Ray cluster have {data_parallel_size} x {threads} CPUs free? (num_threads sets the CPUs "
                    "per replica)"
                ) from e
        except BaseException:
            if owns:
                ray.shutdown()
            raise
        client = cls(actors, facts, routing, owns)
        client.max_step_failures = max_step_failures
        return client

    # ---- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """The replicas' engines run from their construction: nothing to start."""

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # already gone
                pass
        if self._owns_cluster and ray.is_initialized():
            ray.shutdown()

    def _replica_died(self, replica: int, error: BaseException) -> None:
        if not self.router.alive[replica]:
            return
        logger.error("data-parallel replica %d died: %s", replica, error)
        self.router.mark_dead(replica)
        self._last_error[replica] = "dead"
        if not self.router.live_replicas() and self.on_dead is not None:
            try:
                self.on_dead(error)
            except Exception:
                logger.exception("on_dead hook failed")

    # ---- requests ---------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> ReplicaStream:
        token_ids = (prompt.get("prompt_token_ids") or []) if isinstance(prompt, dict) else []
        for _ in range(self.size):
            try:
                decision = self.router.route(token_ids)
            except NoReplicaError as e:
                raise EngineDeadError(str(e)) from e
            actor = self.actors[decision.replica]
            gen = actor.generate.remote(request_id, prompt, params, arrival_time)
            stream = ReplicaStream(self, decision.replica, request_id, gen)
            try:
                await stream.accepted()
            except _ReplicaDied:
                continue  # nothing ran there: try a live replica
            except asyncio.CancelledError:
                stream.abort()
                raise
            return stream
        raise EngineDeadError("Every data-parallel replica is dead.")

    def abort(self, request_ids: str | list[str]) -> None:
        """Aborts on every live replica (a request id lives on one; the others ignore it)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for r in self.router.live_replicas():
            self._abort_on(r, ids)

    def _abort_on(self, replica: int, request_ids: list[str]) -> None:
        if self.router.alive[replica]:
            self.actors[replica].abort.remote(request_ids)  # fire and forget: an abort never blocks

    # ---- state ------------------------------------------------------------------------------
    async def _ask(self, replica: int, method: str, timeout: float = HEALTH_TIMEOUT_S) -> Any:
        """A replica method's answer; _ReplicaDied if its actor is gone."""
        import ray

        try:
            return await asyncio.wait_for(getattr(self.actors[replica], method).remote(), timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self._replica_died(replica, e)
            raise _ReplicaDied from e

    async def _each_replica(self, method: str) -> list[tuple[int, Any]]:
        """(replica, answer or the exception) of every live replica, asked at once."""
        live = self.router.live_replicas()
        answers = await asyncio.gather(*(self._ask(r, method) for r in live), return_exceptions=True)
        return list(zip(live, answers, strict=True))

    async def health_problem(self) -> str | None:
        problems = {r: "dead" for r in range(self.size) if not self.router.alive[r]}
        for r, answer in await self._each_replica("health_problem"):
            if isinstance(answer, _ReplicaDied):
                problems[r] = "dead"
            elif isinstance(answer, BaseException):
                problems[r] = f"no answer ({type(answer).__name__})"
            elif answer is not None:
                problems[r] = answer
        if len(problems) < self.size:
            return None  # some replica serves
        detail = "; ".join(f"replica {r}: {p}" for r, p in sorted(problems.items()))
        return f"No data-parallel replica is serving ({detail})."

    async def get_stats(self) -> dict:
        """Each replica's stats (with its router counters) under ``replicas``, and the sums of the
        counters that add up over replicas at the top level."""
        return await self._gather_stats("get_stats")

    async def get_stats_snapshot(self) -> dict:
        """get_stats() from each replica's last published snapshot: no replica's engine thread is
        queried (AsyncLLMEngine.get_stats_snapshot)."""
        return await self._gather_stats("get_stats_snapshot")

    async def _gather_stats(self, method: str) -> dict:
        replicas: list[dict] = []
        answers = dict(await self._each_replica(method))
        for r in range(self.size):
            answer = answers.get(r)
            alive = self.router.alive[r] and isinstance(answer, dict)
            entry = dict(answer) if alive else {}
            entry.update(
                replica=r,
                alive=alive,
                router_in_flight=self.router.in_flight[r],
                router_requests_routed=self.router.routed[r],
                router_prefix_matched_tokens=self.router.matched_tokens[r],
            )
            replicas.append(entry)
        if not any(e["alive"] for e in replicas):
            raise EngineDeadError("Every data-parallel replica is dead.")
        live = [e for e in replicas if e["alive"]]
        total = {k: sum(e.get(k, 0) for e in live) for k in _SUMMED}
        total["consecutive_step_failures"] = max(e.get("consecutive_step_failures", 0) for e in live)
        return {**total, "data_parallel_size": self.size, "routing": self.router.policy, "replicas": replicas}

    async def get_kv_blocks(self, replica: int | None = None) -> dict:
        r = 0 if replica is None else replica
        if not 0 <= r < self.size:
            raise ValueError(f"replica={replica}: this server runs replicas 0 to {self.size - 1}.")
        if not self.router.alive[r]:
            raise EngineDeadError(f"Data-parallel replica {r} is dead.")
        try:
            return await self._ask(r, "get_kv_blocks")
        except _ReplicaDied as e:
            raise EngineDeadError(f"Data-parallel replica {r} is dead.") from e


def check_data_parallel(config: EngineConfig, data_parallel_size: int) -> None:
    """Refuses a data-parallel size or combination this server cannot run, naming it."""
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}.")
    if data_parallel_size > 1 and config.tensor_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size={data_parallel_size} with tensor_parallel_size={config.tensor_parallel_size} "
            "is not supported: each replica runs one process."
        )
