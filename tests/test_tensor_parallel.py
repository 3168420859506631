"""tensor_parallel_size=2 (the "mp" executor: a worker process and the driver as rank 0) runs the
same greedy tokens as tensor_parallel_size=1 and as Hugging Face transformers, logprobs within
1e-4, for KV heads that split over the ranks (llama, mistral: 2 KV heads) and fewer KV heads
than ranks (qwen2: 1 KV head, replicated), and Qwen3's per-head q/k norms; under chunked
prefill, prefix caching and preemption; on the compiled kernels' fused layer loop and the
reference path. A killed worker is an error naming it, never a hang."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from test_fidelity import assert_greedy_matches_transformers, hf_reference, make_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.layers import tensor_parallel_refusal
from pagedllm.parallel.mp_executor import TensorParallelWorkerError

NEW_TOKENS = 32
# A step that hangs instead of failing would block the test forever: bounded waits only.
ERROR_WAIT_S = 120


def _shutdown(llm: LLM) -> None:
    llm.llm_engine.runner.shutdown()


def _outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]))
    return res


def _assert_same(ours, ref) -> None:
    for (toks, lps), (ref_toks, ref_lps) in zip(ours, ref, strict=True):
        assert toks == ref_toks
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 1e-4


@pytest.mark.parametrize(
    ("family", "backend"),
    [(f, b) for f in ("llama", "qwen2", "mistral") for b in ("auto", "torch")] + [("qwen3", "auto")],
)
def test_tp2_greedy_matches_transformers(tiny_model_dirs, family, backend):
    import pagedllm.kernels

    if backend == "auto" and pagedllm.kernels.load_cpu_kernels() is None:
        pytest.skip("CPU kernels not built here")
    outs = assert_greedy_matches_transformers(
        tiny_model_dirs[family], tensor_parallel_size=2, attention_backend=backend, num_threads=1
    )
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 20  # not a degenerate model


def _stress_prompts() -> list[list[int]]:
    """make_prompts() and prompts sharing a 40-token prefix (prefix-cache hits at admission)."""
    prompts = make_prompts()
    shared = prompts[6][:40]
    return prompts + [shared + [7 + i] * (i + 1) for i in range(4)]


@pytest.mark.parametrize(
    ("family", "preemption_mode"), [("llama", "recompute"), ("qwen2", "recompute"), ("llama", "swap")]
)
def test_tp2_under_chunked_prefill_prefix_caching_and_preemption(tiny_model_dirs, family, preemption_mode):
    """16-token steps chunk every long prompt; 24 blocks of 8 tokens cannot hold the batch, so
    sequences are preempted (recomputed, or swapped out of every rank's cache and back) and come
    back; shared prefixes hit the cache."""
    check_tp2_under_pressure(tiny_model_dirs[family], preemption_mode)


def check_tp2_under_pressure(model_dir: str, preemption_mode: str, **tp_kwargs) -> LLM:
    """Greedy tokens and logprobs of _stress_prompts() at tensor_parallel_size=2 (``tp_kwargs``:
    the executor's settings) equal TP=1's and HF's, in a KV cache that forces preemption, with
    16-token prefill chunks and prefix-cache hits; the TP=2 LLM, shut down."""
    prompts = _stress_prompts()
    ref = hf_reference(model_dir, prompts)
    kwargs = dict(
        model=model_dir,
        dtype="float32",
        num_kv_blocks=24,
        block_size=8,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        preemption_mode=preemption_mode,
        num_threads=1,
    )
    tp1 = _outputs(LLM(**kwargs), prompts)
    llm = LLM(tensor_parallel_size=2, **tp_kwargs, **kwargs)
    try:
        tp2 = _outputs(llm, prompts)
        sched = llm.llm_engine.scheduler
        swaps = sched.num_swap_preemptions
        stats = (sched.num_preemptions, llm.llm_engine.kv_manager.prefix_cache_stats()[1])
    finally:
        _shutdown(llm)
    _assert_same(tp2, tp1)
    _assert_same(tp2, ref)
    assert stats[0] > 0, "the KV cache was meant to be too small: no preemption happened"
    assert stats[1] > 0, "the shared prefixes were meant to hit the prefix cache"
    assert (swaps > 0) == (preemption_mode == "swap")
    return llm


def test_tp2_dequantizes_a_gguf_and_matches_tp1(tiny_llama, tmp_path):
    """quantization=None: a GGUF's weights load dequantized and shard as float, with TP=1's output
    (its quantized blocks sharded: tests/test_tensor_parallel_quantized.py)."""
    from gguf_models import write_gguf

    path = write_gguf(tiny_llama, str(tmp_path / "tiny.gguf"), {})
    prompts = make_prompts(4)
    kwargs = dict(model=path, dtype="float32", num_kv_blocks=64, quantization=None, num_threads=1)
    tp1 = _outputs(LLM(**kwargs), prompts)
    llm = LLM(tensor_parallel_size=2, **kwargs)
    try:
        _assert_same(_outputs(llm, prompts), tp1)
    finally:
        _shutdown(llm)


def test_tp2_shards_kv_heads_and_skips_the_whole_step_decode_plan(tiny_model_dirs):
    import pagedllm.kernels

    if pagedllm.kernels.load_cpu_kernels() is None:
        pytest.skip("CPU kernels not built here")
    llm = LLM(model=tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=8, tensor_parallel_size=2, num_threads=1)
    try:
        model = llm.llm_engine.model
        assert (model.num_heads, model.num_kv_heads) == (2, 1)  # of 4 query / 2 KV heads
        assert llm.llm_engine.runner.kv_caches[0][0].shape[1] == 1  # this rank's KV heads only
        assert model.kernels is not None and model._decoder_plan is None
    finally:
        _shutdown(llm)


def _llm_tp2(model_dir: str) -> LLM:
    return LLM(model=model_dir, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2, num_threads=1)


def _generate_in_thread(llm: LLM, max_tokens: int) -> dict:
    """Runs generate in a thread; the dict gets its error (or None) once it returns."""
    result: dict = {}

    def run():
        try:
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            result["error"] = None
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(ERROR_WAIT_S)
    assert not t.is_alive(), "generate hung after a worker died"
    return result


def test_killed_idle_worker_fails_the_next_step_clearly(tiny_llama):
    llm = _llm_tp2(tiny_llama)
    try:
        worker = llm.llm_engine.runner.executor.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(ERROR_WAIT_S)
        err = _generate_in_thread(llm, 4)["error"]
        assert isinstance(err, TensorParallelWorkerError)
        assert "worker rank 1" in str(err) and "-9" in str(err)
        # and every later step refuses at once, the same way
        assert isinstance(_generate_in_thread(llm, 4)["error"], TensorParallelWorkerError)
    finally:
        _shutdown(llm)


def test_worker_killed_inside_a_step_is_an_error_not_a_hang(tiny_llama):
    llm = _llm_tp2(tiny_llama)
    worker = llm.llm_engine.runner.executor.procs[0]
    core = llm.llm_engine.core

    def kill_at_third_step(_sched) -> None:
        if core.num_steps == 3:
            os.kill(worker.pid, signal.SIGKILL)

    core.on_schedule = kill_at_third_step
    try:
        err = _generate_in_thread(llm, 64)["error"]
        assert isinstance(err, TensorParallelWorkerError), repr(err)
        assert "rank 1" in str(err) or "collective" in str(err)
    finally:
        _shutdown(llm)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(tensor_parallel_size=2, distributed_executor_backend="spark"), "must be None, 'mp', 'ray' or 'uni'"),
        (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "needs 'mp'"),
        (dict(tensor_parallel_size=2, device="cuda"), "CPU only"),
        (dict(tensor_parallel_size=0), "positive integer"),
    ],
)
def test_unsupported_tensor_parallel_settings_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig.from_kwargs(**kwargs)


def test_shapes_that_do_not_split_are_named():
    assert tensor_parallel_refusal(4, 2, 128, 2) is None
    assert tensor_parallel_refusal(4, 1, 128, 2) is None  # one KV head, replicated on both ranks
    assert "attention heads" in tensor_parallel_refusal(6, 2, 128, 4)
    assert "KV heads" in tensor_parallel_refusal(12, 3, 128, 2)
    assert "intermediate" in tensor_parallel_refusal(4, 2, 129, 2)


def _spawned_children(pid: int) -> list[int]:
    """The processes ``pid`` started through multiprocessing's spawn (its workers), by /proc."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(k) for k in f.read().split()]
    out = []
    for k in kids:
        with open(f"/proc/{k}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                out.append(k)
    return out


def test_server_with_tp2_answers_then_turns_unhealthy_when_a_worker_dies(tiny_llama, tmp_path):
    """Also: every socket the server and its worker listen on (HTTP, gloo; the rendezvous is a
    file) is bound to loopback."""
    import httpx
    from listening_sockets import assert_loopback_only
    from test_server import ServerProcess

    srv = ServerProcess(tiny_llama, str(tmp_path / "server.log"), "--tensor-parallel-size", "2")
    try:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url("/v1/completions"), json=body, timeout=60)
        assert r.status_code == 200, r.text
        offline = LLM(model=tiny_llama, dtype="float32", num_kv_blocks=64, num_threads=1).generate(
            [{"prompt_token_ids": body["prompt"]}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
        assert r.json()["choices"][0]["text"] == offline[0].outputs[0].text
        (worker,) = _spawned_children(srv.proc.pid)
        listening = assert_loopback_only(srv.proc.pid, expect_processes=2)
        assert worker in {x.pid for x in listening} and srv.port in {x.port for x in listening}
        os.kill(worker, signal.SIGKILL)
        codes = [httpx.post(srv.url("/v1/completions"), json=body, timeout=ERROR_WAIT_S).status_code for _ in range(4)]
        assert set(codes) == {500}
        assert httpx.get(srv.url("/health"), timeout=10).status_code == 503
        assert "worker rank 1" in srv.log_tail(1_000_000)
    finally:
        srv.stop()


def test_a_worker_lost_before_the_rendezvous_fails_the_start_at_once():
    """The driver waits for the workers to join in short slices: a worker known dead ends the wait
    with its story, long before the rendezvous timeout (600 s)."""
    from pagedllm.parallel.group import TensorParallelGroup
    from pagedllm.parallel.rendezvous import DriverRendezvous

    done = threading.Event()
    errors: list[BaseException] = []
    rendezvous = DriverRendezvous.on_this_node()

    def start() -> None:
        try:
            TensorParallelGroup(0, 2, rendezvous, dead_worker=lambda: "worker rank 1 (pid 0) exited with code 1")
        except BaseException as e:  # what the test checks
            errors.append(e)
        done.set()

    threading.Thread(target=start, daemon=True).start()
    try:
        assert done.wait(ERROR_WAIT_S), "the driver kept waiting for a dead worker"
    finally:
        rendezvous.close()
    assert isinstance(errors[0], TensorParallelWorkerError)
    assert "rank 1" in str(errors[0]) and "before it joined" in str(errors[0])


def test_a_script_without_a_main_guard_gets_an_error_not_a_hang(tiny_llama, tmp_path):
    """Under "spawn" a worker imports the main module again: a script that starts an engine at
    import kills its worker before the worker joins. The start fails, naming the cause."""
    import subprocess
    import sys

    script = tmp_path / "no_main_guard.py"
    script.write_text(
        "from pagedllm import LLM\n"
        f"LLM(model={tiny_llama!r}, dtype='float32', tensor_parallel_size=2, num_threads=1, num_kv_blocks=32)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=ERROR_WAIT_S, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert "before it joined the tensor-parallel group" in proc.stderr
    assert '__name__ == "__main__"' in proc.stderr
