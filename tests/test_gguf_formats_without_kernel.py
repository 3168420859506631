"""A GGUF file with tensors in block formats that have no integer kernel loads natively all the
same: those tensors are dequantized at load (one log line names them), the rest stay in their
blocks. Many downloads are IQ4_XS / IQ4_NL / Q3_K / Q2_K. (llama.cpp's Q4_K_M files also hold
Q5_0 / Q5_1 / Q8_0 tensors wherever a row is not a multiple of 256: those have kernels.)"""

from __future__ import annotations

import logging

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_models import gguf_files_with_cache, tiny_kquant_hf
from test_quantized import _hidden, kernels  # noqa: F401 (a fixture: the compiled kernels, else skip)
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.models.quantized_linear import QuantizedLinear

T = GGMLQuantizationType
# K a multiple of 32 (the tiny llama): the 32-value format without a kernel, next to kernel ones
LEGACY_MIX = {"attn_q": T.Q4_0, "attn_k": T.Q5_0, "attn_v": T.Q5_1, "attn_output": T.IQ4_NL, "ffn_down": T.Q4_1}
# K a multiple of 256: the super-block formats without a kernel
KQUANT_MIX = {"attn_q": T.Q4_K, "attn_k": T.Q3_K, "attn_v": T.Q2_K, "ffn_down": T.IQ4_XS, "ffn_up": T.Q6_K}
WITHOUT_KERNEL = {"legacy": ("IQ4_NL",), "kquant": ("Q3_K", "Q2_K", "IQ4_XS")}
# and the formats of the GEMMs that stay in their blocks (the kinds not named above: Q8_0)
WITH_KERNEL = {"legacy": ("Q4_0", "Q5_0", "Q5_1", "Q4_1", "Q8_0"), "kquant": ("Q4_K", "Q6_K", "Q8_0")}


def logged_gemms(lines: list[str]) -> int:
    """How many GEMMs the load's formats line ("...: GEMMs 27 Q4_K, 9 Q6_K, 36 float float32; ...") counts."""
    (line,) = [line for line in lines if ": GEMMs " in line]
    return sum(int(kind.split()[0]) for kind in line.split(": GEMMs ", 1)[1].split(";")[0].split(", "))


def gemm_modules(model: nn.Module) -> int:
    """The GEMMs the model holds as layers: every GGUF-block and float linear, fused parts apiece."""
    kinds = (QuantizedLinear, nn.Linear)
    return sum(isinstance(m, kinds) or type(m).__name__ == "PackedLinear" for m in model.modules())


@pytest.fixture(scope="module")
def files(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_mixed")
    mixes = {"legacy": (tiny_model_dirs["llama"], LEGACY_MIX), "kquant": (tiny_kquant_hf(str(root / "kq")), KQUANT_MIX)}
    with gguf_files_with_cache(root, mixes) as paths:
        yield paths


@pytest.mark.parametrize("which", ["legacy", "kquant"])
def test_formats_without_kernel_load_dequantized_and_match_the_float_model(files, which, caplog):
    """Native (the kernel formats in their blocks, the others as floats) computes what the model
    dequantized whole at load computes: same values, other matmul order -> fp32 rounding (both
    with a float32 KV cache: the native default, float16, is a rounding of its own)."""
    with caplog.at_level(logging.INFO):
        native = LLM(
            model=files[which],
            dtype="float32",
            num_kv_blocks=32,
            attention_backend="torch",
            quantization="gguf",
            kv_cache_dtype="float32",
        )
    lines = [r.getMessage() for r in caplog.records]
    logged = [line for line in lines if "no integer kernel" in line]
    assert len(logged) == 1 and all(fmt in logged[0] for fmt in WITHOUT_KERNEL[which])
    assert not any(fmt in logged[0] for fmt in WITH_KERNEL[which])
    formats = {m.format for m in native.llm_engine.model.modules() if isinstance(m, QuantizedLinear)}
    assert formats == set(WITH_KERNEL[which])  # each kept in its blocks
    model = native.llm_engine.model
    assert logged_gemms(lines) == gemm_modules(model)  # the dequantized parts of mixed projections too
    attn = model.layers[0].self_attn
    assert any(isinstance(m, QuantizedLinear) for m in model.modules())  # the kernel formats stayed blocks
    assert not isinstance(attn.qkv_proj.local, QuantizedLinear)  # mixed q/k/v: parts, some dequantized
    dequant = LLM(model=files[which], dtype="float32", num_kv_blocks=32, attention_backend="torch", quantization=None)
    ids = torch.tensor([5, 17, 99, 3, 250, 7, 7, 42])
    torch.testing.assert_close(_hidden(native, ids), _hidden(dequant, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("which", ["legacy", "kquant"])
def test_formats_without_kernel_run_under_the_default_settings(files, which):
    """quantization="auto" (the default) on the kernels: loads, and greedy output does not
    depend on batching."""
    llm = LLM(model=files[which], dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + i, 40, 41 + i, 7]} for i in range(4)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone and all(len(t) == 8 for t in together)
