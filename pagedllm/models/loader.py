"""Builds a model from a local Hugging Face folder (config.json + *.safetensors)."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from pagedllm.models.interface import CausalLM
from pagedllm.models.plain_config import read_plain_config
from pagedllm.models.registry import get_model_class

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    model_dir: str,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    pack_weights: bool = True,
    cpu_kernels=None,
    tensor_parallel=None,
) -> CausalLM:
    """Any registered family (registry.py), through the CausalLM contract only. ``cpu_kernels``:
    the compiled CPU kernels (pagedllm.kernels) for the families' fused CPU paths (bf16 and
    float32; bf16 weights also packed for their GEMMs), or None. ``tensor_parallel``: this rank's
    TensorParallelGroup: the model is cut to its shard (parallel/sharding.py) before the kernels
    resolve its layers; its bf16 weights stay unpacked (the packed head has no vocabulary shard)."""
    cls = get_model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config, max_model_len)
    # Materialise on the target device in the target dtype, then fill from the checkpoint.
    model = model.to_empty(device=device).to(dtype=dtype)
    model.load_hf_weights(iter_safetensors(model_dir))
    # to_empty left the non-persistent buffers (RoPE tables...) uninitialised: the model remakes them
    model.init_computed_buffers(device)
    model.eval()
    model.requires_grad_(False)
    # counted before packing turns linear weights into buffers (benchmarks report FLOP per token)
    model.num_params = sum(p.numel() for p in model.parameters())
    if tensor_parallel is not None:
        from pagedllm.parallel.sharding import shard_llama

        shard_llama(model, tensor_parallel)
        pack_weights = False
    if device.type == "cpu" and dtype == torch.bfloat16 and pack_weights:
        model.pack_for_cpu(cpu_kernels)
    if cpu_kernels is not None and hasattr(model, "enable_cpu_kernels"):  # optional: a fused layer path
        model.enable_cpu_kernels(cpu_kernels)
    logger.info("loaded %s from %s (%s, %s)", cls.__name__, model_dir, dtype, device)
    return model
