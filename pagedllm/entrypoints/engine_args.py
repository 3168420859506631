"""Command-line flags for every EngineConfig field (--block-size, --max-num-seqs, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from pagedllm.config import EngineConfig

_HELP = {
    "model": "local Hugging Face folder, .gguf file, or a known name (default: smollm2-135m-instruct)",
    "dtype": "activation / KV dtype: auto | float32 | bfloat16 | float16 (CUDA)",
    "quantization": (
        "auto (default): a GGUF runs in its quantized blocks where the CPU kernels build; gguf: always; "
        "none: dequantize a GGUF to float at load"
    ),
    "block_size": "tokens per KV block",
    "kv_cache_memory_gib": "KV cache size in GiB",
    "num_kv_blocks": "KV cache size in blocks (overrides --kv-cache-memory-gib)",
    "kv_layout": "paged (default) or contiguous (baseline reservation policies)",
    "reserve": "contiguous layout: max | pow2 | oracle",
    "max_model_len": "context length (default: the model's)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decodes)",
    "num_threads": "torch intra-op threads",
    "max_logprobs": "most logprobs / prompt_logprobs a request may ask for (default 20); -1: no cap",
}


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        if hint is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=_HELP.get(f.name))
            continue
        base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        parser.add_argument(flag, type=base[0], default=f.default, help=_HELP.get(f.name))


def engine_kwargs(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict:
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in skip and hasattr(args, f.name)
    }
