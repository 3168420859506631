"""Shapes a compiled kernel refuses take the PyTorch reference path, decided once at load with one
log line, never a failed step (issue 22).

The kernels' refusals are TORCH_CHECKs in C++; CpuKernels writes them down (layer_ops_refusal,
decode_attention_refusal) so the model and the runner can ask before the first step. The first
tests hold those answers against the kernels themselves; the engine tests run tiny models whose
head sizes the kernels handle generically (40) or refuse (520, over the fused RoPE kernel's 512),
in bf16 and float32, and compare them with the reference path and, in float32, Hugging Face. The
last ones make the kernels refuse a shape they do take, so the decision logic runs here even
though this machine's kernels take every shape a tiny model has.
"""

from __future__ import annotations

import logging

import httpx
import pytest
import torch
from test_fidelity import assert_greedy_matches_transformers
from test_server import ServerProcess
from tiny_models import build_model

import pagedllm.kernels
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import load_cpu_kernels
from pagedllm.kernels.interface import CpuKernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels could not be built here")
BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16
REFUSED_HEAD_DIM = 520  # even, but over the fused RoPE kernel's 512
GENERIC_HEAD_DIM = 40  # no SIMD-specialized size: the kernels' portable paths


def _rope_call(dtype: torch.dtype, h: int, hkv: int, d: int) -> None:
    t, block_size, num_blocks = 3, 4, 2
    qkv = torch.randn(t, (h + 2 * hkv) * d).to(dtype)
    cos, sin = torch.ones(8, d, dtype=dtype), torch.zeros(8, d, dtype=dtype)
    k_cache = torch.zeros(num_blocks, hkv, block_size, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    kernels.rope_and_cache_write(qkv, torch.arange(t), cos, sin, k_cache, v_cache, torch.arange(t), h, hkv)


def _decode_call(dtype: torch.dtype, h: int, hkv: int, d: int) -> None:
    k_cache = torch.randn(2, hkv, 4, d).to(dtype)
    q = torch.randn(1, h, d).to(dtype)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, k_cache, k_cache.clone(), torch.tensor([[0, 1]]), torch.tensor([6]), 0.1)


SHAPES = [
    (BF16, 4, 2, 64),
    (F32, 4, 2, 64),
    (BF16, 4, 2, GENERIC_HEAD_DIM),
    (F32, 4, 1, GENERIC_HEAD_DIM),
    (BF16, 4, 2, 512),
    (BF16, 4, 2, REFUSED_HEAD_DIM),
    (F32, 4, 2, REFUSED_HEAD_DIM),
    (BF16, 4, 2, 7),  # odd
    (F32, 2, 2, 15),
    (F16, 4, 2, 64),
    (F32, 3, 2, 16),  # query heads not a multiple of the KV heads
]


@pytest.mark.parametrize("dtype,h,hkv,d", SHAPES)
def test_layer_ops_refusal_is_the_kernels_own_check(dtype, h, hkv, d):
    refusal = kernels.layer_ops_refusal(dtype, h, hkv, d)
    if refusal is None:
        _rope_call(dtype, h, hkv, d)
    else:
        with pytest.raises(RuntimeError):
            _rope_call(dtype, h, hkv, d)


@pytest.mark.parametrize("dtype,h,hkv,d", SHAPES)
def test_decode_attention_refusal_is_the_kernels_own_check(dtype, h, hkv, d):
    refusal = kernels.decode_attention_refusal(dtype, h, hkv, d)
    if refusal is None:
        _decode_call(dtype, h, hkv, d)
    else:
        with pytest.raises(RuntimeError):
            _decode_call(dtype, h, hkv, d)


def test_refusals_say_no_where_expected():
    # The table above must contain both answers, or the two tests would prove half as much.
    assert kernels.layer_ops_refusal(BF16, 4, 2, REFUSED_HEAD_DIM) is not None
    assert kernels.layer_ops_refusal(BF16, 4, 2, 7) is not None
    assert kernels.layer_ops_refusal(F16, 4, 2, 64) is not None
    assert kernels.layer_ops_refusal(BF16, 4, 2, GENERIC_HEAD_DIM) is None
    assert kernels.decode_attention_refusal(F32, 3, 2, 16) is not None
    assert kernels.decode_attention_refusal(BF16, 4, 2, REFUSED_HEAD_DIM) is None


@pytest.fixture(scope="module")
def head_dim_models(tmp_path_factory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("head_dim_models")
    return {
        d: build_model("llama", str(root / f"llama_hd{d}"), head_dim=d) for d in (GENERIC_HEAD_DIM, REFUSED_HEAD_DIM)
    }


PROMPTS = [[1, 5, 9, 200, 3], list(range(10, 60)), [7] * 23]


def _generate(llm: LLM, logprobs: int = 3, max_tokens: int = 12) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]


def _refusal_lines(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if "do not take" in r.getMessage() or "does not take" in r.getMessage()
    ]


def _assert_same_greedy(fast: list, ref: list, exact: bool) -> int:
    """Token-for-token in float32; in bf16, up to a near-tie of the reference (rounding picks either)."""
    compared = 0
    for a, b in zip(fast, ref, strict=True):
        if exact:
            assert a.token_ids == b.token_ids
            compared += len(a.token_ids)
            continue
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            top = sorted((e.logprob for e in b.logprobs[i].values()), reverse=True)
            if x != y:
                assert top[0] - top[1] < 0.1, f"diverged at step {i} without a near-tie: {top}"
                break
            compared += 1
    return compared


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [GENERIC_HEAD_DIM, REFUSED_HEAD_DIM])
def test_unusual_head_dim_serves_the_reference_tokens(head_dim_models, head_dim, dtype, caplog):
    """The kernels run what they take and the reference path the rest; the tokens are the
    reference path's either way, and a refusal is one log line at load."""
    model_dir = head_dim_models[head_dim]
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        fast_llm = LLM(model=model_dir, dtype=dtype, num_kv_blocks=64)
    lines = _refusal_lines(caplog)
    engine = fast_llm.llm_engine
    assert engine.runner.decode_kernel is not None  # the decode kernel's portable path takes any head size
    if head_dim == REFUSED_HEAD_DIM:
        assert engine.model.kernels is None
        assert len(lines) == 1 and f"head_dim {head_dim}" in lines[0], lines
    else:
        assert engine.model.kernels is not None and lines == []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        fast = _generate(fast_llm)
    assert _refusal_lines(caplog) == []  # decided at load: nothing per step
    ref = _generate(LLM(model=model_dir, dtype=dtype, num_kv_blocks=64, attention_backend="torch"))
    assert _assert_same_greedy(fast, ref, exact=dtype == "float32") >= 12
    assert len({t for o in fast for t in o.token_ids}) > 5  # not a degenerate model


@pytest.mark.parametrize("head_dim", [GENERIC_HEAD_DIM, REFUSED_HEAD_DIM])
def test_unusual_head_dim_matches_transformers_in_float32(head_dim_models, head_dim):
    assert_greedy_matches_transformers(head_dim_models[head_dim])


class RefusingKernels(CpuKernels):
    """The real kernels, refusing every shape: what an unsupported model looks like to the engine."""

    def layer_ops_refusal(self, dtype, num_heads, num_kv_heads, head_dim, kv_dtype=None):
        return f"head_dim {head_dim} (refused for the test)"

    def decode_attention_refusal(self, dtype, num_heads, num_kv_heads, head_dim, kv_dtype=None):
        return f"head_dim {head_dim} (refused for the test)"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_refused_shapes_run_the_reference_path_decided_once(tiny_llama, monkeypatch, caplog, dtype):
    refusing = RefusingKernels(kernels._m)
    monkeypatch.setattr(pagedllm.kernels, "load_cpu_kernels", lambda: refusing)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = LLM(model=tiny_llama, dtype=dtype, num_kv_blocks=64)
    engine = llm.llm_engine
    assert engine.parts.kernels is refusing  # the kernels loaded; the shape was refused, not the build
    assert engine.model.kernels is None and engine.runner.decode_kernel is None
    assert engine.runner.prefill_kernel is None or kernels.prefill_attention_available(16, 16)
    lines = _refusal_lines(caplog)
    assert len(lines) == 2 and all("refused for the test" in line for line in lines), lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        fast = _generate(llm)
    assert _refusal_lines(caplog) == []
    ref = _generate(LLM(model=tiny_llama, dtype=dtype, num_kv_blocks=64, attention_backend="torch"))
    # Both are the reference path (the greedy argmax kernel picks torch's first maximum): equal.
    assert [o.token_ids for o in fast] == [o.token_ids for o in ref]


def test_server_on_a_refused_shape_serves_200s_and_stays_healthy(head_dim_models, tmp_path):
    model_dir = head_dim_models[REFUSED_HEAD_DIM]
    srv = ServerProcess(model_dir, str(tmp_path / "server.log"), "--dtype", "bfloat16", "--served-model-name", "m")
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            for i in range(4):  # more than --max-step-failures (3): a failing step would show on /health
                r = c.post("/v1/completions", json={"model": "m", "prompt": f"hello {i}", "max_tokens": 5})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 5 or r.json()["choices"][0]["finish_reason"] == "stop"
            r = c.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
            )
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
            assert c.get("/health").status_code == 200
            stats = srv.wait_idle()
            assert stats["num_step_errors"] == 0
        log = srv.log_tail(1_000_000)
        assert log.count(f"do not take head_dim {REFUSED_HEAD_DIM}") == 1, log
        assert "Traceback" not in log, log
    finally:
        srv.stop()
