"""Connecting this process to Ray (the "ray" executor, data-parallel replicas) without exposing
a cluster on the network.

A cluster's GCS and raylets run whatever a client that reaches them asks, and a local cluster
started with Ray's defaults listens on every interface (its node address is this machine's
network address, even when ``_node_ip_address="127.0.0.1"`` is passed: Ray swaps loopback for it).
So:

- with RAY_ADDRESS set (an address, or ``auto``: the cluster ``ray start`` runs on this node),
  join that cluster: where it listens and how it authenticates is its operator's choice;
- else start a local cluster whose node address is loopback, so that every Ray process binds
  127.0.0.1: Ray's switch for that is RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ("local Ray only", the
  default on macOS and Windows), read when ``ray`` is first imported. No dashboard, and Ray's
  token authentication on unless RAY_AUTH_MODE says otherwise (Ray >= 2.52 has it; later versions
  turn it on for local clusters themselves), so another user of this machine cannot drive it.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from typing import Literal

# Ray's "local Ray only" switch: its node address becomes loopback (read at `import ray`).
_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray():
    """The ray module, or an error saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'") from e
    return ray


def connect_ray(num_cpus: int | None = None) -> Literal["connected", "joined", "started"]:
    """Connects this process to Ray as the module docstring says: "connected" when it already
    was (nothing done), "joined" (RAY_ADDRESS's cluster) or "started" (a local cluster of
    ``num_cpus`` CPUs, None: Ray's count). ``ray.shutdown()`` disconnects, and stops a local
    cluster. Refuses to start a local cluster that would not be bound to loopback."""
    imported = sys.modules.get("ray")
    if imported is not None and imported.is_initialized():
        return "connected"
    if os.environ.get("RAY_ADDRESS"):
        import_ray().init()
        return "joined"
    # Set before ray.init (and, for the first, before `import ray`): the cluster's processes,
    # and the actors they start, inherit them.
    os.environ[_LOCAL_ONLY_ENV] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    ray = import_ray()
    node_ip = ray.util.get_node_ip_address()  # what the local cluster would bind
    if not ipaddress.ip_address(node_ip).is_loopback:
        raise RuntimeError(
            f"a local Ray cluster started here would listen on {node_ip}, not loopback: this process "
            f"imported ray before pagedllm set {_LOCAL_ONLY_ENV}=0 (Ray reads it at import). Set it "
            "before importing ray, call ray.init() yourself before starting the engine, or set "
            "RAY_ADDRESS to join a cluster."
        )
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    return "started"
