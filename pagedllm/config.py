"""Engine configuration: one validated dataclass, vLLM's option names."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedllm.kv.contiguous import RESERVE_POLICIES

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_KV_LAYOUTS = ("paged", "contiguous")
_PREEMPTION_MODES = ("recompute", "swap", "auto")
_QUANTIZATIONS = ("auto", "gguf", None)


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Sizes are in tokens unless named otherwise."""

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    dtype: str = "auto"  # activations and KV cache; weights per `quantization`
    # "gguf": a GGUF model's weights stay in their quantized blocks (integer kernels). "auto": the
    # same wherever the CPU kernels build, else dequantize at load. None (CLI: none): dequantize a
    # GGUF to float32 at load.
    quantization: str | None = "auto"
    device: str = "cpu"
    seed: int = 0
    # KV cache
    block_size: int = 16
    kv_cache_memory_gib: float = 4.0
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gib when set
    kv_layout: str = "paged"
    reserve: str = "max"  # contiguous layout only: how much each request reserves at admission
    # On by default as in vLLM: measured free on a workload with no shared prefixes (200 ShareGPT
    # requests, 61.9 s on vs 61.2 s off, within run-to-run noise).
    enable_prefix_caching: bool = True
    # Scheduler
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # "recompute" | "swap" | "auto" (swap n > 1 / beam groups, recompute the rest): see scheduler.py
    preemption_mode: str = "recompute"
    swap_space_gib: float = 4.0  # host-memory KV pool for swapping (allocated only if the mode can swap)
    num_swap_blocks: int | None = None  # overrides swap_space_gib when set
    # Runtime
    num_threads: int | None = None  # torch intra-op threads; None: leave torch's default
    attention_backend: str = "auto"  # "auto": compiled CPU kernels when they build; "torch": reference
    # Requests
    # The most logprobs / prompt_logprobs a request may ask for (vLLM's default 20); -1: no cap.
    # A request's -1 (the whole vocabulary) counts as the vocabulary size, as in vLLM.
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        if isinstance(self.quantization, str) and self.quantization.lower() == "none":
            self.quantization = None
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {_QUANTIZATIONS}, got {self.quantization!r}.")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}.")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}.")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib!r}.")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}.")
        if self.kv_layout not in _KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {_KV_LAYOUTS}, got {self.kv_layout!r}.")
        if self.reserve not in RESERVE_POLICIES:
            raise ValueError(f"reserve must be one of {RESERVE_POLICIES}, got {self.reserve!r}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}.")
        if self.attention_backend not in ("auto", "torch"):
            raise ValueError(f"attention_backend must be 'auto' or 'torch', got {self.attention_backend!r}.")
        if self.preemption_mode not in _PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {_PREEMPTION_MODES}, got {self.preemption_mode!r}.")
        if not self.swap_space_gib >= 0:
            raise ValueError(f"swap_space_gib must be >= 0, got {self.swap_space_gib!r}.")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 (no cap), got {self.max_logprobs!r}.")
        if self.num_swap_blocks is not None and (not isinstance(self.num_swap_blocks, int) or self.num_swap_blocks < 0):
            raise ValueError(f"num_swap_blocks must be a non-negative integer, got {self.num_swap_blocks!r}.")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(unknown)}. Known: {', '.join(sorted(known))}.")
        return cls(**kwargs)  # type: ignore[arg-type]
