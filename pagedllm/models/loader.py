"""The one model loader: a family's model from a stream of checkpoint tensors (a Hugging Face
folder's safetensors or a GGUF file's tensors), plus the config and dtype it is read with."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open

from pagedllm.layers.checkpoint import CheckpointTensor
from pagedllm.layers.linear_method import LinearMethods
from pagedllm.models.interface import CausalLM
from pagedllm.models.plain_config import read_plain_config
from pagedllm.models.registry import get_model_class
from pagedllm.parallel.group import TensorParallelGroup

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# vLLM's 8-bit cache names: unscaled float8 (vLLM's k_scale = v_scale = 1.0 when uncalibrated), and
# int8 with float32 scales per token, KV head and group of values (pagedllm/attention/int8_kv.py).
_KV_DTYPES = {**_DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def load_hf_config(model_dir: str):
    """The model's config: read directly for the folders GGUF conversion writes (see
    plain_config: same values, without AutoConfig's imports), else transformers' AutoConfig."""
    plain = read_plain_config(model_dir)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def cpu_supports_bf16() -> bool:
    """True where bf16 matmuls run natively (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slow."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = fh.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, activation_dtype: torch.dtype, quantized_weights: bool = False
) -> torch.dtype:
    """The KV cache's element type. "auto": float16 for a model whose weights run in their GGUF
    blocks (float32 activations, already rounded to int8 / int16 at every GEMM; a float16 cache
    halves its bytes per token and moved perplexity by <= 0.07% on the default model and Gemma 3
    270M, benchmarks/results/kv_cache_dtype; llama.cpp's default cache is f16 too), else the
    activation dtype (float checkpoints keep their reference-exact outputs). A named dtype: the
    activation dtype itself, or a 16-bit store under float32 activations (float16 too on the
    CPU: only the cache's loads and stores convert). bf16 activations in a float16 cache (or
    the reverse) would round K/V to a format that is not narrower, only different: refused."""
    if kv_cache_dtype == "auto":
        return torch.float16 if quantized_weights and activation_dtype == torch.float32 else activation_dtype
    kv = _KV_DTYPES[kv_cache_dtype]
    if kv != activation_dtype and activation_dtype != torch.float32:
        act = str(activation_dtype).removeprefix("torch.")
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} with {act} activations: a KV cache narrower than the activations "
            "needs dtype='float32'; use kv_cache_dtype='auto'."
        )
    return kv


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    """'auto' is the checkpoint's own dtype where the device runs it well, else float32."""
    if dtype != "auto":
        if dtype == "float16" and device.type == "cpu":
            raise ValueError("dtype 'float16' is only supported on CUDA; use 'bfloat16' or 'float32' on the CPU.")
        return _DTYPES[dtype]
    own = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(own, str):
        own = _DTYPES.get(own)
    if own not in (torch.bfloat16, torch.float16):
        return torch.float32
    if device.type == "cuda":
        return own if own != torch.bfloat16 or torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"No *.safetensors weights in {model_dir!r}.")
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def load_model(
    weights: Iterable[tuple[str, CheckpointTensor]],
    hf_config,
    methods: LinearMethods,
    max_model_len: int,
    tensor_parallel: TensorParallelGroup | None = None,
) -> CausalLM:
    """Any registered family (registry.py), from a stream of (Hugging Face name, tensor or GGUF
    block rows): ``iter_safetensors`` of a folder, or ``gguf_weights`` of a file. The model is
    built as ``tensor_parallel``'s rank (None: the whole model), each layer keeps its shard of
    every tensor, and the weights run as ``methods`` says (decided once, by the caller). Then
    the fused CPU layer path where the family has one and ``methods.kernels`` are given."""
    cls = get_model_class(hf_config)
    model = cls(hf_config, max_model_len, tp=tensor_parallel)
    # what the layers hold before loading is small (norms, learned positions): made in place
    model = model.to(device=methods.device, dtype=methods.dtype)
    model.num_params = 0  # counted by the loads: the whole model's, whatever shard a rank keeps
    model.load_weights(weights)
    model.finish_weights(methods)
    # the non-persistent buffers (RoPE tables...) are computed, in float32, on the device
    model.init_computed_buffers(methods.device)
    model.eval()
    model.requires_grad_(False)
    if methods.kernels is not None and hasattr(model, "enable_cpu_kernels"):  # optional: a fused layer path
        model.enable_cpu_kernels(methods.kernels)
    logger.info("loaded %s (%s, %s)", cls.__name__, methods.dtype, methods.device)
    return model
