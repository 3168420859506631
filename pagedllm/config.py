"""Engine configuration: one validated dataclass, vLLM's option names."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, fields

from pagedllm.kv.contiguous import RESERVE_POLICIES
from pagedllm.spec_decode.config import SpeculativeConfig, parse_speculative_config
from pagedllm.vllm_args import translate_engine_kwargs

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's (and torch's) other spellings
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_TOKENIZER_MODES = ("auto", "slow")
DEFAULT_KV_CACHE_MEMORY_GIB = 4.0
_KV_LAYOUTS = ("paged", "contiguous")
_PREEMPTION_MODES = ("recompute", "swap", "auto")
_QUANTIZATIONS = ("auto", "gguf", None)
# kv_cache_dtype: "auto" (models/loader.py resolve_kv_cache_dtype) or a named store, in vLLM's names
# ("fp8" is its e4m3; "int8" is scaled per token, KV head and group of values,
# pagedllm/attention/int8_kv.py).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8")
_KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Sizes are in tokens unless named otherwise."""

    model: str = "smollm2-135m-instruct"
    # A hub name's revision in the local Hugging Face cache: a ref ("main", a branch, a tag) or a
    # commit hash. None (vLLM's default): "main".
    revision: str | None = None
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"  # "auto": the fast tokenizer where there is one; "slow": the Python one
    # No tokenizer: prompts must be token ids, outputs carry token ids and empty text (vLLM's meaning).
    skip_tokenizer_init: bool = False
    # A Jinja chat template (inline, or a file path) replacing the tokenizer's, as vLLM's --chat-template.
    chat_template: str | None = None
    # Default sampling of requests that leave a field unset: "auto" (vLLM's default) the model's
    # generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens),
    # "vllm" SamplingParams' own defaults, or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # Accepted for vLLM's command lines, no effect: pagedllm runs its own model code for the
    # architectures it knows and never executes code shipped with a checkpoint.
    trust_remote_code: bool = False
    dtype: str = "auto"  # activations (and the KV cache under kv_cache_dtype "auto"); weights per `quantization`
    # The KV cache's element type, independent of the activations (vLLM's option): "auto" (float16
    # for GGUF weights run in their blocks, else the activation dtype), "float32", "bfloat16" or
    # "float16". K/V are rounded to it as they are written and read back widened to the activations'.
    kv_cache_dtype: str = "auto"
    # "gguf": a GGUF model's weights stay in their quantized blocks (integer kernels). "auto": the
    # same wherever the CPU kernels build, else dequantize at load. None (CLI: none): dequantize a
    # GGUF to float32 at load.
    quantization: str | None = "auto"
    device: str = "cpu"
    seed: int = 0
    # KV cache
    block_size: int = 16
    # KV cache size. Precedence: num_kv_blocks, then kv_cache_memory_gib, then gpu_memory_utilization
    # (see memory_budget.py: the fraction of the device's memory this process may hold, model
    # included, as in vLLM); with none set, DEFAULT_KV_CACHE_MEMORY_GIB.
    kv_cache_memory_gib: float | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float | None = None
    kv_layout: str = "paged"
    reserve: str = "max"  # contiguous layout only: how much each request reserves at admission
    # On by default as in vLLM: measured free on a workload with no shared prefixes (200 ShareGPT
    # requests, 61.9 s on vs 61.2 s off, within run-to-run noise).
    enable_prefix_caching: bool = True
    # vLLM's: sliding-window layers attend to the whole context, capped at the window (no block
    # release); False: they attend through their window at any context length.
    disable_sliding_window: bool = False
    # Scheduler
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Prefills are always chunked to the step's token budget; False is accepted (outputs are the
    # same, only how prompts are split into steps differs) with a warning at start-up.
    enable_chunked_prefill: bool = True
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
    # Ranks the model is sharded over (Megatron-style, parallel/): worker processes on this node,
    # gloo collectives, CPU only for now. Pipeline parallelism: only 1 (vLLM's default).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # How tensor-parallel ranks run (vLLM's name): None or "mp" (worker processes this engine
    # starts on this node); "ray" (Ray actors, on this node or a cluster's); "uni" (one process)
    # only with tensor_parallel_size=1.
    distributed_executor_backend: str | None = None
    # The network interface (e.g. "eth1") "ray" ranks on several nodes listen and connect on,
    # unauthenticated (docs/scaling.md). None: ranks must all run on the driver's node, and
    # everything they listen on is bound to loopback.
    distributed_interface: str | None = None
    # Speculative decoding (vLLM's dict, or its JSON text): n-gram prompt lookup or a draft model,
    # see spec_decode/config.py for the keys; None: off.
    speculative_config: dict | None = None
    # Accepted, no effect: vLLM's switch to skip CUDA graph capture; pagedllm runs eagerly always.
    enforce_eager: bool = False
    # Accepted, no effect: the engine logs no periodic stats (they are on /metrics and /stats).
    disable_log_stats: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.quantization, str) and self.quantization.lower() == "none":
            self.quantization = None
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {_QUANTIZATIONS}, got {self.quantization!r}.")
        if isinstance(self.dtype, str):
            self.dtype = _DTYPE_ALIASES.get(self.dtype.lower(), self.dtype.lower())
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {(*_DTYPES, *_DTYPE_ALIASES)}, got {self.dtype!r}.")
        kv = str(self.kv_cache_dtype).lower()
        kv = _DTYPE_ALIASES.get(kv, kv)  # the dtype spellings
        self.kv_cache_dtype = _KV_CACHE_DTYPE_ALIASES.get(kv, kv)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}.")
        if self.tokenizer_mode not in _TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode must be one of {_TOKENIZER_MODES}, got {self.tokenizer_mode!r}.")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}.")
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size!r} is not supported yet: "
                "use 1 (tensor_parallel_size splits a model over processes)."
            )
        self._check_tensor_parallel()
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}.")
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
        self._check_speculative()

    def _check_speculative(self) -> None:
        spec = parse_speculative_config(self.speculative_config)
        if spec is None:
            return
        if isinstance(self.speculative_config, str):  # the command line's JSON text
            self.speculative_config = json.loads(self.speculative_config)
        if self.kv_layout != "paged":
            raise ValueError(
                "speculative_config needs kv_layout='paged': rejected drafts give their slots back block by block."
            )
        if spec.uses_draft_model and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config: a draft model with tensor_parallel_size > 1 is not supported: the draft "
                "would run on every rank (use n-gram speculation, or tensor_parallel_size=1)."
            )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative_config, or None when speculation is off."""
        return parse_speculative_config(self.speculative_config)

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}.")
        backend = self.distributed_executor_backend
        if backend not in (None, "mp", "ray", "uni"):
            raise ValueError(f"distributed_executor_backend must be None, 'mp', 'ray' or 'uni', got {backend!r}.")
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'")
        interface = self.distributed_interface
        if interface is not None and (backend != "ray" or not isinstance(interface, str) or not interface):
            raise ValueError(
                f"distributed_interface={interface!r}: an interface name, for distributed_executor_backend='ray' "
                "only (the other executors run every rank on this node, over loopback)."
            )
        if tp == 1:
            return
        if backend == "uni":
            raise ValueError(
                f"distributed_executor_backend='uni' runs one process: tensor_parallel_size={tp} needs 'mp' or 'ray'."
            )
        if self.device != "cpu":
            raise ValueError(f"tensor_parallel_size={tp} runs on the CPU only for now (gloo), not {self.device!r}.")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """The config of ``LLM(...)``'s keyword arguments: pagedllm's fields and vLLM's names
        (see vllm_args.py). vLLM arguments pagedllm cannot honour raise UnsupportedEngineArgument
        (a ValueError) naming them; names neither knows raise TypeError."""
        known = {f.name for f in fields(cls)}
        return cls(**translate_engine_kwargs(kwargs, known))  # type: ignore[arg-type]
