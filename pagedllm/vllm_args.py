"""vLLM's engine-argument vocabulary: which of its names pagedllm takes, renames or refuses.

``EngineConfig.from_kwargs`` (``LLM(...)``) and ``pagedllm serve`` read arguments through this, so
a script or command line written for vLLM either runs or stops at once with an error naming the
argument pagedllm cannot honour, and a misspelt name is never silently dropped.

* Arguments that are EngineConfig fields are pagedllm's own (most are vLLM's names already).
* ``VLLM_ALIASES``: vLLM names of an EngineConfig field spelt differently here.
* ``VLLM_UNSUPPORTED``: the rest of vLLM's EngineArgs, each with vLLM's default. Passing the default
  changes nothing, so it is accepted (scripts often spell defaults out); any other value raises
  UnsupportedEngineArgument.
* Any other name raises TypeError, as an unexpected keyword argument does.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Collection

logger = logging.getLogger("pagedllm")

# vLLM name -> EngineConfig field
VLLM_ALIASES: dict[str, str] = {
    "swap_space": "swap_space_gib",
    "num_gpu_blocks_override": "num_kv_blocks",
}

# vLLM's EngineArgs that pagedllm does not implement, with vLLM's default value.
VLLM_UNSUPPORTED: dict[str, object] = {
    "additional_config": None,
    "allowed_local_media_path": "",
    "async_scheduling": False,
    "calculate_kv_scales": False,
    "code_revision": None,
    "collect_detailed_traces": None,
    "compilation_config": None,
    "config_format": "auto",
    "cpu_offload_gb": 0,
    "cuda_graph_sizes": None,
    "data_parallel_address": None,
    "data_parallel_backend": "mp",
    "data_parallel_rank": None,
    "data_parallel_rpc_port": None,
    "data_parallel_size": 1,
    "data_parallel_size_local": None,
    "disable_async_output_proc": False,
    "disable_cascade_attn": False,
    "disable_chunked_mm_input": False,
    "disable_custom_all_reduce": False,
    "disable_hybrid_kv_cache_manager": False,
    "disable_mm_preprocessor_cache": False,
    "download_dir": None,
    "enable_eplb": False,
    "enable_expert_parallel": False,
    "enable_lora": False,
    "enable_lora_bias": False,
    "enable_prompt_adapter": False,
    "enable_prompt_embeds": False,
    "enable_reasoning": False,
    "enable_sleep_mode": False,
    "fully_sharded_loras": False,
    "guided_decoding_backend": None,
    "hf_config_path": None,
    "hf_overrides": None,
    "hf_token": None,
    "ignore_patterns": None,
    "kv_events_config": None,
    "kv_transfer_config": None,
    "limit_mm_per_prompt": None,
    "load_format": "auto",
    "logits_processor_pattern": None,
    "logits_processors": None,
    "logprobs_mode": "raw_logprobs",
    "long_lora_scaling_factors": None,
    "long_prefill_token_threshold": 0,
    "lora_dtype": "auto",
    "lora_extra_vocab_size": 256,
    "max_cpu_loras": None,
    "max_logprobs": 20,
    "max_long_partial_prefills": 1,
    "max_lora_rank": 16,
    "max_loras": 1,
    "max_num_partial_prefills": 1,
    "max_parallel_loading_workers": None,
    "max_prompt_adapter_token": 0,
    "max_prompt_adapters": 1,
    "max_seq_len_to_capture": 8192,
    "mm_processor_kwargs": None,
    "model_impl": "auto",
    "model_loader_extra_config": None,
    "multi_step_stream_outputs": True,
    "num_lookahead_slots": 0,
    "num_redundant_experts": 0,
    "num_scheduler_steps": 1,
    "otlp_traces_endpoint": None,
    "override_generation_config": None,
    "override_neuron_config": None,
    "override_pooler_config": None,
    "prefix_caching_hash_algo": "builtin",
    "pt_load_map_location": "cpu",
    "qlora_adapter_name_or_path": None,
    "quantization_param_path": None,
    "ray_workers_use_nsight": False,
    "reasoning_parser": None,
    "rope_scaling": None,
    "rope_theta": None,
    "scheduler_cls": None,
    "scheduler_delay_factor": 0.0,
    "scheduling_policy": "fcfs",
    "served_model_name": None,
    "show_hidden_metrics_for_version": None,
    "structured_outputs_config": None,
    "task": "auto",
    "tokenizer_pool_extra_config": None,
    "tokenizer_pool_size": 0,
    "tokenizer_pool_type": "ray",
    "tokenizer_revision": None,
    "use_tqdm_on_load": True,
    "use_v2_block_manager": True,
    "worker_cls": "auto",
    "worker_extension_cls": "",
}


class UnsupportedEngineArgument(ValueError):
    """A vLLM engine argument, given a value other than vLLM's default, that pagedllm cannot honour."""

    def __init__(self, name: str, value: object, flag: bool = False) -> None:
        shown = "--" + name.replace("_", "-") if flag else name
        super().__init__(
            f"pagedllm does not support vLLM's engine argument {shown} (got {value!r}); "
            f"only its default {VLLM_UNSUPPORTED[name]!r} is accepted."
        )
        self.name = name


def is_vllm_default(name: str, value: object) -> bool:
    """Whether ``value`` is vLLM's default for the unsupported argument ``name`` (a command line's
    strings compare by their text: ``--load-format auto``)."""
    default = VLLM_UNSUPPORTED[name]
    if isinstance(value, str) and not isinstance(default, str):
        return value == str(default)
    return value == default


def translate_engine_kwargs(kwargs: dict[str, object], known: Collection[str]) -> dict[str, object]:
    """``kwargs`` as EngineConfig fields (``known``): vLLM's aliases renamed, vLLM's unsupported
    arguments at their default dropped. Raises UnsupportedEngineArgument or TypeError."""
    out: dict[str, object] = {}
    unknown = []
    for name, value in kwargs.items():
        field = VLLM_ALIASES.get(name, name) if name not in known else name
        if field in known:
            if field in out:  # only an alias and its field can collide: kwargs' names are distinct
                raise TypeError(f"{name} and {field} name the same engine argument; give one.")
            out[field] = value
        elif name in VLLM_UNSUPPORTED:
            if not is_vllm_default(name, value):
                raise UnsupportedEngineArgument(name, value)
            logger.debug("vLLM engine argument %s=%r is its default: ignored", name, value)
        else:
            unknown.append(name)
    if unknown:
        hints = []
        for name in sorted(unknown):
            close = difflib.get_close_matches(name, [*known, *VLLM_ALIASES], n=1)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise TypeError(
            f"Unknown engine argument(s): {', '.join(hints)}. Neither pagedllm's nor vLLM's; "
            f"known: {', '.join(sorted(known))}."
        )
    return out
