"""The "ray" executor: tensor-parallel ranks 1..N-1 as Ray actors, on this node or others.

As vLLM does it: the ranks' CPUs are reserved by one placement group, a bundle of
``{"CPU": threads}`` per rank, bundle 0 on the driver's node (rank 0 is the engine's own process,
as with "mp"; its bundle keeps Ray from scheduling other work onto its CPUs). Strategy PACK (vLLM's
too): the bundles go on as few nodes as hold them, so a model that fits one node communicates over
loopback, and ranks spill onto other nodes only when this one is full. SPREAD would scatter the
ranks even when one node holds them all (every collective a network hop); STRICT_PACK would refuse
a model that needs more than one node.

Connecting: a Ray already initialized in this process is used as it is; else the cluster
RAY_ADDRESS names (``auto``: the one ``ray start`` runs on this node), else a local one bound to
loopback (ray_cluster.py). The executor kills its actors and removes its placement group at
shutdown; it disconnects from Ray only if it connected itself.

Rendezvous (rendezvous.py): ranks that all landed on the driver's node meet through a FileStore
in a private directory and talk over loopback; ranks on other nodes need the operator to name
the network interface they may listen on (``distributed_interface``), else the start fails.

A worker's death shows on the ObjectRef of its step loop (the actor's one long call): it becomes
ready with RayActorError when the actor's process dies (killed, ray.kill, its node lost), and
``ray.wait(..., timeout=0)`` checks that without blocking before every step.
"""

from __future__ import annotations

import logging
import os
import uuid
import weakref

import torch

from pagedllm.config import EngineConfig
from pagedllm.parallel.group import TensorParallelGroup
from pagedllm.parallel.ray_cluster import connect_ray, import_ray
from pagedllm.parallel.rendezvous import DriverRendezvous, Rendezvous
from pagedllm.parallel.worker import TensorParallelExecutor, run_rank, threads_per_rank

logger = logging.getLogger("pagedllm")

# How long start-up waits for the cluster to grant the placement group (its CPUs may be held by
# other work for a while); read at start so a deployment can change it.
PLACEMENT_TIMEOUT_ENV = "PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S"
# How long start-up waits for each actor's process to start (import torch, answer its first call).
ACTOR_START_TIMEOUT_S = 300.0


class RankActor:
    """One worker rank in a Ray actor's process (made a Ray actor class in RayExecutor.start)."""

    def __init__(self, threads: int) -> None:
        torch.set_num_threads(threads)  # the CPUs of this rank's bundle

    def info(self) -> tuple[int, str, str]:
        """(pid, node IP, node id) of this actor's process."""
        import ray

        return os.getpid(), ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def run(self, config: EngineConfig, rank: int, rendezvous: Rendezvous) -> None:
        """The step loop; returns when the driver broadcasts the stop message."""
        run_rank(config, rank, rendezvous)


class RayExecutor(TensorParallelExecutor):
    """The driver's side: the worker actors, their placement group and rank 0's process group."""

    # Ray reports an actor dead once its raylet and the GCS have seen the process go: later than
    # gloo sees the closed connection.
    death_report_wait_s = 10.0

    def __init__(
        self,
        config: EngineConfig,
        tp: TensorParallelGroup,
        actors: list,
        names: list[str],
        infos: list[tuple[int, str, str]],
        loops: list,
        placement_group,
        rendezvous: DriverRendezvous,
        connected_here: bool,
    ) -> None:
        super().__init__(config, tp)
        self.actors = actors
        self.actor_names = names
        self.worker_pids = [pid for pid, _, _ in infos]
        self.worker_nodes = [ip for _, ip, _ in infos]
        self.loops = loops  # the ObjectRef of each worker's run(): ready only when it stops
        self.placement_group = placement_group
        self.rendezvous = rendezvous
        self._finalizer = weakref.finalize(self, _release, actors, placement_group, tp, rendezvous, connected_here)

    @classmethod
    def start(cls, config: EngineConfig) -> RayExecutor:
        """Reserves the ranks' CPUs, starts ranks 1..N-1 as actors, joins the group as rank 0."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine is already running in this process (its process group is "
                "the default one): shut it down first (LLM.shutdown()) or run the other in its own process."
            )
        # Before anything imports ray: a local cluster's loopback binding is set at its import.
        connected_here = connect_ray() != "connected"  # RAY_ADDRESS's cluster, else a local one
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world, threads = config.tensor_parallel_size, threads_per_rank(config)
        driver_ip = ray.util.get_node_ip_address()
        # vLLM's way to pin bundle 0 to the driver's node: a sliver of the node's own resource.
        bundles = [{"CPU": threads, f"node:{driver_ip}": 0.001}] + [{"CPU": threads}] * (world - 1)
        tag = f"pagedllm-tp-{uuid.uuid4().hex[:8]}"  # names this engine's group and actors
        pg = placement_group(bundles, strategy="PACK", name=tag)
        actors: list = []
        rendezvous: DriverRendezvous | None = None
        try:
            _wait_for_placement(ray, pg, bundles)
            actor_cls = ray.remote(RankActor)
            names = [f"{tag}-rank{r}" for r in range(1, world)]
            for rank, name in zip(range(1, world), names, strict=True):
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
                actors.append(
                    actor_cls.options(name=name, num_cpus=threads, scheduling_strategy=strategy).remote(threads)
                )
            infos = ray.get([a.info.remote() for a in actors], timeout=ACTOR_START_TIMEOUT_S)
            rendezvous = _driver_rendezvous(config, ray.get_runtime_context().get_node_id(), driver_ip, infos)
            loops = [a.run.remote(config, rank, rendezvous.spec) for rank, a in enumerate(actors, start=1)]
            torch.set_num_threads(threads)
            pids, nodes = [pid for pid, _, _ in infos], [ip for _, ip, _ in infos]
            tp = TensorParallelGroup(0, world, rendezvous, dead_worker=lambda: _dead_loop(loops, names, pids, nodes))
        except BaseException:
            for a in actors:
                ray.kill(a)
            remove_placement_group(pg)
            if rendezvous is not None:
                rendezvous.close()
            if connected_here:
                ray.shutdown()
            raise
        logger.info("pagedllm: tensor parallel x%d on Ray, workers (pid, node IP, node id) %s", world, infos)
        return cls(config, tp, actors, names, infos, loops, pg, rendezvous, connected_here)

    def _dead_worker(self) -> str | None:
        return _dead_loop(self.loops, self.actor_names, self.worker_pids, self.worker_nodes)

    def _wait_workers_exit(self, timeout: float) -> None:
        import ray

        ray.wait(self.loops, num_returns=len(self.loops), timeout=timeout)


def _driver_rendezvous(
    config: EngineConfig, driver_node: str, driver_ip: str, infos: list[tuple[int, str, str]]
) -> DriverRendezvous:
    """Loopback when every rank landed on the driver's node (PACK puts them there when it has the
    CPUs); else the interface the operator named, or an error: ranks on several nodes listen on a
    network, unauthenticated, and only the operator knows which network is private."""
    elsewhere = sorted({ip for _, ip, node in infos if node != driver_node})
    if not elsewhere:
        return DriverRendezvous.on_this_node()
    if config.distributed_interface is None:
        raise RuntimeError(
            f"tensor-parallel ranks landed on other nodes ({', '.join(elsewhere)}) than the driver's "
            f"({driver_ip}): ranks on several nodes connect over a network interface, without "
            "authentication. Name one that only the cluster's nodes reach with distributed_interface "
            "(--distributed-interface; see docs/scaling.md), or give the ranks fewer CPUs (num_threads) "
            "so that they fit this node."
        )
    return DriverRendezvous.on_interface(config.distributed_interface)


def _dead_loop(loops: list, names: list[str], pids: list[int], nodes: list[str]) -> str | None:
    """The first worker whose step loop (its run() call) has ended: died, failed or left; or None."""
    import ray

    ready, _ = ray.wait(loops, num_returns=len(loops), timeout=0)
    for rank, ref in enumerate(loops, start=1):
        if ref not in ready:
            continue
        i = rank - 1
        where = f"Ray actor {names[i]}, pid {pids[i]} on {nodes[i]}"
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as e:
            return f"tensor-parallel worker rank {rank} ({where}) died: {_first_line(e)}"
        except Exception as e:
            return f"tensor-parallel worker rank {rank} ({where}) failed: {_first_line(e)}"
        return f"tensor-parallel worker rank {rank} ({where}) left its step loop"
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _wait_for_placement(ray, pg, bundles: list[dict]) -> None:
    """Waits for the cluster to grant the placement group, or says what it lacks."""
    timeout = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, "120"))
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        raise RuntimeError(
            f"the Ray cluster did not grant the tensor-parallel placement group in {timeout:g}s "
            f"({PLACEMENT_TIMEOUT_ENV}): it needs the bundles {bundles} (one per rank, the first on "
            f"the driver's node), the cluster has {ray.cluster_resources()} of which "
            f"{ray.available_resources()} are free. Lower num_threads, or add nodes."
        )


def _release(actors: list, pg, tp: TensorParallelGroup, rendezvous: DriverRendezvous, connected_here: bool) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    if ray.is_initialized():  # at interpreter exit Ray may be gone first, and its actors with it
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
    tp.destroy()
    rendezvous.close()
    if connected_here:
        ray.shutdown()
