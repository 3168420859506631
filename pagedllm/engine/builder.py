"""Builds what an engine runs on from an EngineConfig: model (+ CPU kernels), tokenizer, KV cache
sized to the memory given, the KV manager, the swap pool, the scheduler and the runner."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from pagedllm.chat_template import load_chat_template
from pagedllm.config import DEFAULT_KV_CACHE_MEMORY_GIB, EngineConfig
from pagedllm.generation_defaults import load_generation_defaults
from pagedllm.host_memory import keep_freed_memory_in_heap, release_freed_heap
from pagedllm.kernels.interface import CpuKernels
from pagedllm.kv.base import KVCacheManager
from pagedllm.kv.factory import make_kv_manager
from pagedllm.layers.linear_method import LinearMethods, log_weight_formats
from pagedllm.memory_budget import kv_cache_budget_bytes
from pagedllm.models.attention_windows import layer_windows, sliding_window
from pagedllm.models.hub_cache import is_repo_id
from pagedllm.models.loader import iter_safetensors, load_hf_config, load_model, resolve_dtype, resolve_kv_cache_dtype
from pagedllm.models.plain_config import PlainLlamaConfig
from pagedllm.runner.kv_cache import allocate_kv_cache, kv_bytes_per_block, num_blocks_for_memory
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.scheduler import Scheduler
from pagedllm.spec_decode.draft_load import attach_draft, load_draft_model
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger("pagedllm")


@dataclass
class EngineParts:
    config: EngineConfig
    model_path: str
    hf_config: object
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    model: torch.nn.Module
    tokenizer: object | None  # None with skip_tokenizer_init
    eos_token_ids: set[int]
    default_sampling: dict[str, object]  # SamplingParams fields from generation_config
    kernels: CpuKernels | None
    num_kv_blocks: int
    num_swap_blocks: int
    kv_manager: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner  # or a TensorParallelRunner (parallel/worker.py): the same execute()
    kv_bytes_per_block: int  # this rank's (its KV heads only under tensor parallelism), a draft's included
    kv_dtype: torch.dtype  # of the KV cache
    draft_kv_bytes_per_block: int = 0  # of kv_bytes_per_block, the draft model's cache (speculative_config)


@dataclass
class LoadedModel:
    """What one rank loads: the model (this rank's shard under tensor parallelism) and its facts."""

    model_path: str
    hf_config: object
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    kernels: CpuKernels | None
    model: torch.nn.Module
    kv_dtype: torch.dtype  # of the KV cache (kv_cache_dtype; "auto": the activation dtype)


def load_engine_model(config: EngineConfig, tensor_parallel=None) -> LoadedModel:
    """Resolves and loads the model of ``config`` with the CPU kernels where they build.
    ``tensor_parallel``: this rank's TensorParallelGroup, or None for the whole model."""
    from pagedllm.models.resolve import resolve_model_path

    device = torch.device(config.device)
    kernels = engine_kernels(config)
    native_gguf = native_gguf_path(config, kernels)
    model_path = resolve_model_path(config.model, weights=native_gguf is None, revision=config.revision)
    hf_config = load_hf_config(model_path)
    max_model_len = resolve_max_model_len(hf_config, config.max_model_len, config.disable_sliding_window)
    if config.disable_sliding_window:
        # vLLM's meaning: every layer attends to the whole context, which the cap above keeps
        # within the window, so the outputs are the windowed model's.
        hf_config.sliding_window = None
    dtype = resolve_dtype(config.dtype, hf_config, device)
    if device.type == "cpu":
        keep_freed_memory_in_heap()
    methods = linear_methods(dtype, device, kernels)
    if native_gguf is not None:
        from pagedllm.models.gguf_weights import gguf_weights

        weights = gguf_weights(native_gguf, hf_config)
    else:
        weights = iter_safetensors(model_path)
    model = load_model(weights, hf_config, methods, max_model_len, tensor_parallel)
    log_weight_formats(model, native_gguf or model_path, kernels)
    from pagedllm.models.quantized_linear import runs_weight_blocks  # here: gguf loads only when used

    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, quantized_weights=runs_weight_blocks(model))
    return LoadedModel(model_path, hf_config, max_model_len, dtype, device, kernels, model, kv_dtype)


def linear_methods(dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None) -> LinearMethods:
    """How every weight runs, decided here once: bf16 weights packed for the CPU's GEMM where
    packing works in this torch build, GGUF blocks on the integer kernels where they built."""
    from pagedllm.models.cpu_linear import bf16_packing_available

    pack = device.type == "cpu" and dtype == torch.bfloat16 and bf16_packing_available()
    return LinearMethods(dtype=dtype, kernels=kernels, pack_bf16=pack, device=device)


def build_runner(config: EngineConfig, loaded: LoadedModel, num_kv_blocks: int, num_swap_blocks: int) -> ModelRunner:
    """The runner over a fresh KV cache of ``num_kv_blocks`` (and a host swap pool if any)."""
    model, kv_dtype = loaded.model, loaded.kv_dtype

    def caches(num_blocks: int, dev: torch.device):
        return allocate_kv_cache(
            len(model.layers), num_blocks, config.block_size, model.num_kv_heads, model.head_dim, kv_dtype, dev
        )

    kv_caches = caches(num_kv_blocks, loaded.device)
    # Pinned host memory would make device->host copies asynchronous on CUDA; CPU: plain.
    host_caches = caches(num_swap_blocks, torch.device("cpu")) if num_swap_blocks else None
    return ModelRunner(
        model,
        kv_caches,
        config.block_size,
        loaded.max_model_len,
        loaded.device,
        config.seed,
        loaded.kernels,
        host_caches,
    )


def build_engine(config: EngineConfig) -> EngineParts:
    t0 = time.perf_counter()
    executor = None
    if config.tensor_parallel_size > 1:
        executor = _start_executor(config)  # rank 0 is this process
    elif config.num_threads:
        torch.set_num_threads(config.num_threads)
    try:
        parts = _build_parts(config, executor)
    except BaseException:
        if executor is not None:
            executor.shutdown(graceful=False)
        raise
    logger.info(
        "pagedllm: %s (%s) on %s, %s%s; KV cache %s, %d blocks x %d tokens = %d tokens (%.2f GiB, "
        "%d bytes per token%s), max_model_len %d; ready in %.1fs",
        parts.model_path,
        type(parts.model).__name__,
        parts.device,
        str(parts.dtype).removeprefix("torch."),
        f", tensor parallel x{config.tensor_parallel_size}" if executor is not None else "",
        str(parts.kv_dtype).removeprefix("torch."),
        parts.num_kv_blocks,
        config.block_size,
        parts.num_kv_blocks * config.block_size,
        parts.num_kv_blocks * parts.kv_bytes_per_block / 2**30,
        parts.kv_bytes_per_block // config.block_size,
        f", of them {parts.draft_kv_bytes_per_block // config.block_size} the draft model's"
        if parts.draft_kv_bytes_per_block
        else "",
        parts.max_model_len,
        time.perf_counter() - t0,
    )
    return parts


def _start_executor(config: EngineConfig):
    """The tensor-parallel executor of ``distributed_executor_backend``, its workers started."""
    if config.distributed_executor_backend == "ray":
        from pagedllm.parallel.ray_executor import RayExecutor

        return RayExecutor.start(config)
    from pagedllm.parallel.mp_executor import MultiprocExecutor

    return MultiprocExecutor.start(config)


def _build_parts(config: EngineConfig, executor) -> EngineParts:
    loaded = load_engine_model(config, None if executor is None else executor.tp)
    model, device, dtype = loaded.model, loaded.device, loaded.dtype
    tokenizer = None if config.skip_tokenizer_init else _tokenizer(config, loaded.model_path, loaded.hf_config)
    default_sampling = load_generation_defaults(config.generation_config, loaded.model_path)
    if not config.enable_chunked_prefill:
        logger.warning("enable_chunked_prefill=False: prefills are still chunked to max_num_batched_tokens")
    if device.type == "cpu":
        release_freed_heap()  # before the KV cache: what loading freed goes back to the OS

    # Under tensor parallelism: this rank's KV heads; every rank holds as many blocks.
    per_block = _bytes_per_block(config, loaded)
    draft = None
    if config.speculative is not None and config.speculative.uses_draft_model:
        draft = load_draft_model(config, loaded, tokenizer)
    # A draft model's cache has a block for each of the target's (same ids): both count in the budget.
    draft_per_block = _bytes_per_block(config, draft) if draft is not None else 0
    num_kv_blocks = _num_kv_blocks(config, per_block + draft_per_block, device)
    kv_manager = make_kv_manager(config, num_kv_blocks, loaded.max_model_len, release_window(loaded.hf_config))
    num_swap_blocks = _enable_swap(config, kv_manager, per_block)
    scheduler = Scheduler(config, kv_manager, loaded.max_model_len)
    runner = build_runner(config, loaded, num_kv_blocks, num_swap_blocks)
    if draft is not None:
        attach_draft(config, runner, loaded.max_model_len, draft, num_kv_blocks)
    if executor is not None:
        runner = executor.start_steps(runner, num_kv_blocks, num_swap_blocks)
    return EngineParts(
        config,
        loaded.model_path,
        loaded.hf_config,
        loaded.max_model_len,
        dtype,
        device,
        model,
        tokenizer,
        eos_token_ids(loaded.hf_config, tokenizer, loaded.model_path),
        default_sampling,
        loaded.kernels,
        num_kv_blocks,
        num_swap_blocks,
        kv_manager,
        scheduler,
        runner,
        per_block + draft_per_block,
        loaded.kv_dtype,
        draft_per_block,
    )


def _bytes_per_block(config: EngineConfig, loaded: LoadedModel) -> int:
    model = loaded.model
    return kv_bytes_per_block(len(model.layers), config.block_size, model.num_kv_heads, model.head_dim, loaded.kv_dtype)


def tokenizer_path(config: EngineConfig, model_path: str) -> str:
    """Where the tokenizer loads from: the ``tokenizer`` argument, else the model's folder."""
    if config.tokenizer and is_repo_id(config.tokenizer) and not os.path.exists(config.tokenizer):
        # A hub name, looked up in the local cache as the model is: AutoTokenizer would download it.
        # At "main": tokenizer_revision is vLLM's argument pagedllm refuses.
        from pagedllm.models.resolve import resolve_model_path

        return resolve_model_path(config.tokenizer, weights=False)
    return config.tokenizer or model_path


def _tokenizer(config: EngineConfig, model_path: str, hf_config) -> object:
    tok_path = tokenizer_path(config, model_path)
    # The plain config spares AutoTokenizer the AutoConfig it would load (an AutoConfig one saves nothing)
    own_config = tok_path == model_path and isinstance(hf_config, PlainLlamaConfig)
    tokenizer = load_tokenizer(tok_path, hf_config if own_config else None, use_fast=config.tokenizer_mode != "slow")
    if config.chat_template is not None:
        tokenizer.chat_template = load_chat_template(config.chat_template)
    return tokenizer


def _num_kv_blocks(config: EngineConfig, per_block: int, device: torch.device) -> int:
    """KV blocks per the precedence of EngineConfig: blocks, GiB, memory fraction, default GiB."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_gib is None and config.gpu_memory_utilization is not None:
        budget = kv_cache_budget_bytes(config.gpu_memory_utilization, device)
        if budget < per_block:
            raise ValueError(
                f"gpu_memory_utilization={config.gpu_memory_utilization} leaves {budget} bytes for the KV "
                f"cache, less than one block ({per_block} bytes)."
            )
        return budget // per_block
    gib = config.kv_cache_memory_gib if config.kv_cache_memory_gib is not None else DEFAULT_KV_CACHE_MEMORY_GIB
    num_blocks = num_blocks_for_memory(gib, per_block)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_gib={gib} is less than one KV block ({per_block} bytes).")
    return num_blocks


def engine_kernels(config: EngineConfig) -> CpuKernels | None:
    """The compiled CPU kernels every part of the engine uses (GEMMs of GGUF blocks and packed
    bf16, the fused layer loop, attention), decided here once; None on other devices and with
    attention_backend="torch" (the PyTorch reference path for everything)."""
    if config.device != "cpu" or config.attention_backend != "auto":
        return None
    from pagedllm.kernels import load_cpu_kernels

    return load_cpu_kernels()


def native_gguf_path(config: EngineConfig, kernels: CpuKernels | None = None) -> str | None:
    """The GGUF file whose weights load in their quantized blocks, or None (dequantize / HF folder).
    ``kernels``: engine_kernels(config) (looked up when not given)."""
    from pagedllm.models.resolve import gguf_source

    source = gguf_source(config.model, config.revision)
    if config.quantization == "gguf":
        if source is None:
            raise ValueError(f"quantization='gguf' needs a GGUF model (a .gguf file), got {config.model!r}.")
        if config.device != "cpu":
            raise ValueError("quantization='gguf' runs on the CPU only; quantization=None dequantizes at load.")
        return source
    if config.quantization != "auto" or source is None or config.device != "cpu":
        return None
    # "auto" runs the blocks natively where the integer kernels run. Without them (no compiler, or
    # the reference backend) each forward would dequantize every layer again: dequantizing once at
    # load is faster there.
    from pagedllm.models.gguf_weights import tensor_parallel_refusal

    if (kernels if kernels is not None else engine_kernels(config)) is None:
        return None
    if config.tensor_parallel_size > 1:
        # "gguf" refuses such a file at load; "auto" runs it as it can: float weights shard anywhere
        refusal = tensor_parallel_refusal(source, config.tensor_parallel_size)
        if refusal is not None:
            logger.warning("pagedllm: %s: the file loads dequantized to float", refusal)
            return None
    return source


def _enable_swap(config: EngineConfig, kv_manager: KVCacheManager, bytes_per_block: int) -> int:
    """Gives the manager a host-memory pool when the preemption mode may swap; its size in blocks."""
    if config.preemption_mode == "recompute":
        return 0
    num_host = config.num_swap_blocks
    if num_host is None:
        num_host = num_blocks_for_memory(config.swap_space_gib, bytes_per_block)
    if num_host < 1:
        if config.preemption_mode == "swap":
            raise ValueError(
                f"preemption_mode='swap' needs host memory: swap_space_gib="
                f"{config.swap_space_gib} is less than one KV block ({bytes_per_block} bytes)."
            )
        return 0
    try:
        kv_manager.enable_swap(num_host)
    except NotImplementedError as e:
        if config.preemption_mode == "swap":
            raise ValueError(f"preemption_mode='swap' needs kv_layout='paged' ({e}).") from e
        return 0  # "auto": this layout only recomputes
    return num_host


def release_window(hf_config) -> int | None:
    """The window out of which KV blocks can be released: the widest, when every layer attends
    through one (a full-attention layer needs every block while its sequence lives)."""
    windows = layer_windows(hf_config)
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def resolve_max_model_len(hf_config, wanted: int | None, disable_sliding_window: bool = False) -> int:
    """The context length: the model's, or ``wanted`` within it. Sliding-window layers attend
    through their window at any length; ``disable_sliding_window`` (vLLM's) makes them attend to
    everything instead, and so caps the context at the smallest window."""
    model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    window = sliding_window(hf_config)
    if disable_sliding_window and window is not None and window < model_len:
        logger.info("disable_sliding_window: max_model_len capped at the sliding window %d", window)
        model_len = window
    if wanted is None:
        return model_len
    if wanted > model_len:
        raise ValueError(f"max_model_len={wanted} exceeds the model's context length ({model_len}).")
    return wanted


def eos_token_ids(hf_config, tokenizer, model_path: str) -> set[int]:
    """Every token id that ends generation: the config's, the tokenizer's, generation_config's."""
    ids: set[int] = set()
    for src in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    try:
        from transformers import GenerationConfig

        e = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update([e] if isinstance(e, int) else (e or []))
    except Exception:  # no generation_config.json: the config's and tokenizer's EOS suffice
        pass
    return ids
