"""Command-line flags for every EngineConfig field (--block-size, --max-num-seqs, ...), under vLLM's
spellings too (--swap-space), and vLLM's other engine flags refused by name (see vllm_args.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from pagedllm.config import EngineConfig
from pagedllm.vllm_args import VLLM_ALIASES, VLLM_UNSUPPORTED, UnsupportedEngineArgument, is_vllm_default

_HELP = {
    "model": (
        "local Hugging Face folder, .gguf file, a hub name (org/name) in the local Hugging Face cache, "
        "or a known name (default: smollm2-135m-instruct)"
    ),
    "revision": "hub name's revision in the local cache: a branch, tag or commit hash (default: main)",
    "dtype": "activation / KV dtype: auto | float32 | bfloat16 | float16 (CUDA)",
    "quantization": (
        "auto (default): a GGUF runs in its quantized blocks where the CPU kernels build; gguf: always; "
        "none: dequantize a GGUF to float at load"
    ),
    "block_size": "tokens per KV block",
    "kv_cache_memory_gib": "KV cache size in GiB (default: 4, or per --gpu-memory-utilization)",
    "num_kv_blocks": "KV cache size in blocks (overrides the other KV size flags)",
    "gpu_memory_utilization": (
        "fraction of the device's memory (on the CPU: the host's, or the container limit) this process "
        "may hold, model included; the rest of that share after loading is the KV cache"
    ),
    "swap_space_gib": "host memory for KV swapped out on preemption (preemption modes swap / auto)",
    "chat_template": "chat template replacing the tokenizer's: a file path or the Jinja text itself",
    "generation_config": (
        "default sampling of requests that leave it unset: auto (the model's generation_config.json), "
        "vllm (vLLM's defaults) or a folder with a generation_config.json"
    ),
    "skip_tokenizer_init": "no tokenizer: token-id prompts only, outputs carry token ids and empty text",
    "tokenizer_mode": "auto | slow",
    "tensor_parallel_size": "ranks to shard the model over (CPU; see --distributed-executor-backend)",
    "pipeline_parallel_size": "only 1",
    "distributed_executor_backend": (
        "how tensor-parallel ranks run: mp (worker processes on this node; the default) | "
        "ray (Ray actors of the cluster RAY_ADDRESS names, else of a local one bound to loopback)"
    ),
    "distributed_interface": (
        "network interface (e.g. eth1) Ray ranks on several nodes listen and connect on, without "
        "authentication: a private network only (docs/scaling.md); default: none, every rank on this node "
        "over loopback"
    ),
    "enforce_eager": "accepted for vLLM's command lines; pagedllm always runs eagerly",
    "enable_chunked_prefill": "prefills are always chunked to --max-num-batched-tokens",
    "trust_remote_code": "accepted; pagedllm never runs code shipped with a checkpoint",
    "disable_log_stats": "accepted; pagedllm logs no periodic stats (see /metrics)",
    "kv_cache_dtype": "the KV cache's element type: auto (float16 for GGUF weights run in their blocks, else "
    "the activation dtype), float32, bfloat16, float16, fp8 (= fp8_e4m3), fp8_e5m2 or int8 (float32 scales per "
    "token and KV head: one per head up to 64 values, else per 32 values)",
    "kv_layout": "paged (default) or contiguous (baseline reservation policies)",
    "reserve": "contiguous layout: max | pow2 | oracle",
    "max_model_len": "context length (default: the model's)",
    "disable_sliding_window": "sliding-window layers attend to everything, context capped at the window",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decodes)",
    "num_threads": "torch intra-op threads",
    "max_logprobs": "most logprobs / prompt_logprobs a request may ask for (default 20); -1: no cap",
    "speculative_config": (
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": N, "prompt_lookup_min": M, "disable_by_batch_size": B}'
    ),
}


def _json_object(text: str) -> dict:
    """A flag's JSON object (vLLM's --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class _RefuseVllmFlag(argparse.Action):
    """A vLLM engine flag pagedllm does not implement: an error naming it, unless given vLLM's default."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = True if values is None else values
        if not is_vllm_default(self.dest, value):
            parser.error(str(UnsupportedEngineArgument(self.dest, value, flag=True)))


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(EngineConfig)
    aliases: dict[str, list[str]] = {}
    for vllm_name, field in VLLM_ALIASES.items():
        aliases.setdefault(field, []).append(_flag(vllm_name))
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flags = [_flag(f.name), *aliases.get(f.name, [])]
        hint = hints[f.name]
        if hint is bool:
            parser.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=f.default, help=_HELP.get(f.name)
            )
            continue
        base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        kind = _json_object if base[0] is dict else base[0]
        parser.add_argument(*flags, type=kind, default=f.default, help=_HELP.get(f.name))
    for name in VLLM_UNSUPPORTED:
        flag = _flag(name)
        if name in skip or flag in parser._option_string_actions:  # the command has its own
            continue
        # Hidden: listing ~100 flags that only fail would bury the real ones in --help. Not stored:
        # a refused flag never reaches EngineConfig.
        parser.add_argument(flag, nargs="?", action=_RefuseVllmFlag, dest=name, help=argparse.SUPPRESS)


def engine_kwargs(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict:
    """The EngineConfig fields among the parsed flags."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in skip and hasattr(args, f.name)
    }
