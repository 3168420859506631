"""Where tensor-parallel ranks meet (parallel/rendezvous.py): on one node a FileStore in a private
directory and gloo on loopback; across nodes only on the interface the operator names, the TCP
store bound to that interface's address (torch's own TCPStore server listens on every interface).
The server-level checks (every socket of a TP=2 / DP=2 server on loopback) are in
tests/test_tensor_parallel.py, tests/test_ray_executor.py and tests/test_data_parallel.py."""

from __future__ import annotations

import os
import stat
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from listening_sockets import listeners

from pagedllm.config import EngineConfig
from pagedllm.parallel.group import TensorParallelGroup
from pagedllm.parallel.ray_executor import _driver_rendezvous
from pagedllm.parallel.rendezvous import (
    LOOPBACK_INTERFACE,
    DriverRendezvous,
    Rendezvous,
    gloo_interface,
    interface_address,
)

WAIT_S = 120


def test_one_node_store_is_a_file_in_a_private_directory_removed_at_close():
    rdv = DriverRendezvous.on_this_node()
    folder = os.path.dirname(rdv.spec.file)
    try:
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert rdv.spec.interface == LOOPBACK_INTERFACE and rdv.spec.host is None
        store = rdv.serve(2, timedelta(seconds=10))
        rdv.spec.join(2, timedelta(seconds=10)).set("k", "v")  # another rank's view of the same file
        assert store.get("k") == b"v"
    finally:
        rdv.close()
    assert not os.path.exists(folder)
    rdv.close()  # idempotent


def test_interface_addresses_and_an_unknown_interface():
    assert interface_address(LOOPBACK_INTERFACE) == "127.0.0.1"
    with pytest.raises(ValueError, match=r"'no-such0'.*interfaces: .*\blo\b"):
        interface_address("no-such0")


def test_gloo_interface_is_set_inside_and_restored_after(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    with gloo_interface("lo"):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth9"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with gloo_interface("lo"):
        pass
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def _rank1(spec: Rendezvous) -> None:
    """Rank 1 of a 2-rank group: one all-reduce, then it waits for the driver's stop message."""
    torch.set_num_threads(1)
    tp = TensorParallelGroup(1, 2, spec)
    tp.all_reduce(torch.ones(3))
    tp.broadcast_object()
    tp.destroy()


def test_a_group_over_a_named_interface_listens_on_that_address_only():
    """The multi-node path, on one node: interface "lo". The store's socket is bound to the
    interface's address (a plain TCPStore given 127.0.0.1 listens on "::"), and rank 1's gloo
    listens there too. Rank 1 runs in a process of its own (one default group per process)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    rdv = DriverRendezvous.on_interface(LOOPBACK_INTERFACE)
    worker = mp.get_context("spawn").Process(target=_rank1, args=(rdv.spec,), daemon=True)
    worker.start()
    tp = None
    try:
        tp = TensorParallelGroup(
            0, 2, rdv, dead_worker=lambda: None if worker.is_alive() else f"rank 1 exited ({worker.exitcode})"
        )
        x = torch.ones(3)
        assert tp.all_reduce(x).tolist() == [2.0, 2.0, 2.0]
        store = [x for x in listeners(os.getpid()) if x.port == rdv.spec.port]
        assert [(x.proto, x.address) for x in store] == [("tcp", "127.0.0.1")]
        rank1 = listeners(worker.pid)
        assert rank1 and {x.address for x in rank1} <= {"127.0.0.1", "::1"}, rank1
        tp.broadcast_object(None)  # rank 1 leaves its loop
        worker.join(WAIT_S)
        assert worker.exitcode == 0
    finally:
        if tp is not None:
            tp.destroy()
        if worker.is_alive():
            worker.kill()
        rdv.close()


def _infos(*nodes: str) -> list[tuple[int, str, str]]:
    return [(100 + i, f"10.0.0.{i}", node) for i, node in enumerate(nodes)]


def test_ray_ranks_on_the_driver_node_meet_on_loopback_and_elsewhere_need_a_named_interface():
    config = EngineConfig.from_kwargs(tensor_parallel_size=2, distributed_executor_backend="ray")
    rdv = _driver_rendezvous(config, "driver-node", "10.0.0.9", _infos("driver-node"))
    try:
        assert rdv.spec.file is not None and rdv.spec.interface == LOOPBACK_INTERFACE
    finally:
        rdv.close()
    with pytest.raises(RuntimeError, match=r"other nodes \(10\.0\.0\.1\).*--distributed-interface"):
        _driver_rendezvous(config, "driver-node", "10.0.0.9", _infos("driver-node", "other-node"))
    named = EngineConfig.from_kwargs(
        tensor_parallel_size=2, distributed_executor_backend="ray", distributed_interface=LOOPBACK_INTERFACE
    )
    rdv = _driver_rendezvous(named, "driver-node", "10.0.0.9", _infos("other-node"))
    try:
        assert (rdv.spec.file, rdv.spec.host, rdv.spec.interface) == (None, "127.0.0.1", LOOPBACK_INTERFACE)
    finally:
        rdv.close()


def test_serve_takes_the_interface_flag():
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.engine_args import engine_kwargs

    argv = ["serve", "m", "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    args = build_parser(["serve"]).parse_args([*argv, "--distributed-interface", "eth1"])
    assert engine_kwargs(args)["distributed_interface"] == "eth1"
    assert engine_kwargs(build_parser(["serve"]).parse_args(argv))["distributed_interface"] is None


@pytest.mark.parametrize("backend", [None, "mp"])
def test_a_named_interface_is_refused_where_every_rank_runs_on_this_node(backend):
    with pytest.raises(ValueError, match="distributed_interface='eth1'.*'ray' only"):
        EngineConfig.from_kwargs(
            tensor_parallel_size=2, distributed_executor_backend=backend, distributed_interface="eth1"
        )
