"""distributed_executor_backend="ray": tensor_parallel_size=2 with rank 1 a Ray actor (on a local
cluster this module starts once) runs the same greedy tokens as tensor_parallel_size=1 and as HF
transformers, for KV heads that split over the ranks (llama) and fewer KV heads than ranks (qwen2),
under chunked prefill, prefix caching and preemption. A worker actor killed (its process, or
ray.kill) is an error naming its rank, never a hang. Shutting the engine down stops its workers:
the Ray actors and placement group are gone, and (the "mp" executor) the worker processes exit.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import sys
import tempfile
import time

import pytest
from test_tensor_parallel import ERROR_WAIT_S, _generate_in_thread, check_tp2_under_pressure

from pagedllm import LLM
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.parallel.worker import TensorParallelWorkerError
from pagedllm.sampling_params import SamplingParams

ray = pytest.importorskip("ray")
from ray.util import placement_group_table  # noqa: E402

from pagedllm.parallel.ray_executor import PLACEMENT_TIMEOUT_ENV, RayExecutor, import_ray  # noqa: E402

RAY = dict(distributed_executor_backend="ray")
# A tiny TP=2 engine: one thread per rank, a KV cache no test here fills.
TP2 = dict(dtype="float32", num_kv_blocks=64, tensor_parallel_size=2, num_threads=1)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster of this module's own (its own temp dir: never another test's cluster):
    2 CPUs, one per rank at num_threads=1."""
    # Short: Ray's socket paths under it must fit a Unix socket's 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="pgl-ray-")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _ray_llm(model_dir: str) -> LLM:
    return LLM(model=model_dir, **TP2, **RAY)


def _assert_released(executor: RayExecutor) -> None:
    """The executor's actors are gone from the cluster (their names free) and its placement group
    removed. Ray tears an actor down asynchronously after ray.kill: bounded polling."""
    deadline = time.monotonic() + ERROR_WAIT_S
    for name in executor.actor_names:
        while True:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            assert time.monotonic() < deadline, f"actor {name} still alive after shutdown"
            time.sleep(0.1)
    assert placement_group_table(executor.placement_group)["state"] == "REMOVED"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_ray_tp2_matches_tp1_and_hf_under_chunked_prefill_prefix_caching_and_preemption(
    ray_cluster, tiny_model_dirs, family
):
    """llama: 2 KV heads, one per rank; qwen2: 1 KV head, replicated on both ranks."""
    llm = check_tp2_under_pressure(tiny_model_dirs[family], "recompute", **RAY)
    executor = llm.llm_engine.runner.executor
    assert isinstance(executor, RayExecutor)
    # the worker is an actor of its own process on this (the only) node
    assert executor.worker_pids[0] != os.getpid()
    assert executor.worker_nodes == [ray.util.get_node_ip_address()]
    _assert_released(executor)


def test_killed_actor_process_fails_the_next_step_clearly(ray_cluster, tiny_llama):
    llm = _ray_llm(tiny_llama)
    executor = llm.llm_engine.runner.executor
    try:
        os.kill(executor.worker_pids[0], signal.SIGKILL)
        ray.wait(executor.loops, timeout=ERROR_WAIT_S)  # Ray has seen it die
        err = _generate_in_thread(llm, 4)["error"]
        assert isinstance(err, TensorParallelWorkerError), repr(err)
        assert "worker rank 1" in str(err) and "died" in str(err)
        # and every later step refuses at once, the same way
        again = _generate_in_thread(llm, 4)["error"]
        assert isinstance(again, TensorParallelWorkerError) and str(again) == str(err)
    finally:
        llm.shutdown()
    _assert_released(executor)


def test_actor_killed_by_ray_inside_a_step_is_an_error_not_a_hang(ray_cluster, tiny_llama):
    llm = _ray_llm(tiny_llama)
    executor = llm.llm_engine.runner.executor
    core = llm.llm_engine.core

    def kill_at_third_step(_sched) -> None:
        if core.num_steps == 3:
            ray.kill(executor.actors[0])

    core.on_schedule = kill_at_third_step
    try:
        err = _generate_in_thread(llm, 64)["error"]
        assert isinstance(err, TensorParallelWorkerError), repr(err)
        assert "rank 1" in str(err) or "collective" in str(err)
        assert isinstance(_generate_in_thread(llm, 4)["error"], TensorParallelWorkerError)
    finally:
        llm.shutdown()
    _assert_released(executor)


async def _one_request(engine: AsyncLLMEngine) -> list[int]:
    stream = await engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))
    tokens: list[int] = []
    async for out in stream:
        tokens = out.outputs[0].token_ids
    return tokens


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_async_engine_shutdown_stops_the_workers(request, tiny_llama, backend):
    """What the server's lifespan does on exit: the workers leave their loops at the stop
    message (exit code 0 / the loop call returns), then nothing of them is left, their
    rendezvous (a FileStore in a private directory: every rank is on this node) included."""
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    config = EngineConfig.from_kwargs(model=tiny_llama, **TP2, distributed_executor_backend=backend)
    engine = AsyncLLMEngine.from_config(config)
    executor = engine.engine.runner.executor
    rendezvous_dir = os.path.dirname(executor.rendezvous.spec.file)
    assert stat.S_IMODE(os.stat(rendezvous_dir).st_mode) == 0o700
    engine.start()
    try:
        assert len(asyncio.run(_one_request(engine))) == 4
    finally:
        engine.shutdown()
    assert not os.path.exists(rendezvous_dir)
    if backend == "mp":
        assert [p.exitcode for p in executor.procs] == [0]
    else:
        assert ray.get(executor.loops, timeout=0) == [None]  # the loop returned: a clean stop
        _assert_released(executor)
    engine.engine.add_request("after", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    with pytest.raises(TensorParallelWorkerError, match="shut down"):
        engine.engine.step()
    engine.engine.shutdown()  # idempotent


def test_placement_the_cluster_cannot_grant_is_a_clear_error(ray_cluster, tiny_llama, monkeypatch):
    """2 ranks x 2 threads need 4 CPUs of a 2-CPU cluster: an error naming what is missing, not a
    wait forever, and the pending placement group is removed."""
    import torch.distributed as dist

    monkeypatch.setenv(PLACEMENT_TIMEOUT_ENV, "1")
    with pytest.raises(RuntimeError, match="did not grant the tensor-parallel placement group"):
        LLM(model=tiny_llama, tensor_parallel_size=2, num_threads=2, **RAY)
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
    assert not dist.is_initialized()


def test_ray_not_installed_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` finds without the package
    with pytest.raises(ValueError, match=r"pip install 'pagedllm\[ray\]'"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, **RAY)
    with pytest.raises(ImportError, match=r"pip install 'pagedllm\[ray\]'"):
        import_ray()


def test_server_on_ray_listens_on_loopback_only(tiny_llama, tmp_path):
    """`pagedllm serve --tensor-parallel-size 2 --distributed-executor-backend ray` without
    RAY_ADDRESS: the Ray cluster it starts (GCS, raylet, agents, the rank actor's worker) and the
    ranks' gloo connections listen on loopback only, and it serves."""
    import httpx
    from listening_sockets import assert_loopback_only
    from test_server import ServerProcess

    env = {"RAY_ADDRESS": ""}  # its own local cluster, never one this test run started
    args = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray", "--num-threads", "1")
    srv = ServerProcess(tiny_llama, str(tmp_path / "server.log"), *args, env=env, wait=False)
    srv.wait_healthy(timeout=300)  # Ray's start, then the actor's
    try:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url("/v1/completions"), json=body, timeout=60)
        assert r.status_code == 200, r.text
        # the server, and Ray's GCS and raylet at least
        listening = assert_loopback_only(srv.proc.pid, expect_processes=3)
        assert srv.port in {x.port for x in listening}
    finally:
        srv.stop()


def test_a_local_cluster_that_would_not_be_on_loopback_is_refused():
    """connect_ray sets Ray's local-only switch before ray is first imported; in a process that
    imported ray before (the switch comes too late) it refuses to start a cluster on this node's
    network address rather than expose it."""
    import ipaddress
    import subprocess

    script = (
        "import ray\n"
        "from pagedllm.parallel.ray_cluster import connect_ray\n"
        "print(ray.util.get_node_ip_address(), flush=True)\n"
        "try:\n"
        "    connect_ray()\n"
        "except RuntimeError as e:\n"
        "    print('refused:', e)\n"
        "print('initialized:', ray.is_initialized())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env["RAY_ADDRESS"] = ""
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    node_ip = proc.stdout.splitlines()[0]
    if ipaddress.ip_address(node_ip).is_loopback:
        pytest.skip("this machine's Ray node address is loopback anyway")
    assert f"refused: a local Ray cluster started here would listen on {node_ip}, not loopback" in proc.stdout
    assert "initialized: False" in proc.stdout
