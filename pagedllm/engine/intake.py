"""Request intake: prompts to token ids, and the checks that a request can ever run."""

from __future__ import annotations

import numbers

from pagedllm.kv.base import KVCacheManager
from pagedllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict


def token_ids_of(ids: object) -> list[int]:
    """Validates a token-id prompt: a list of ints (numpy ints accepted, bools and floats not)."""
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}.")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise ValueError(f"prompt_token_ids must be integers (token ids), got {bad[:3]!r}.")
    return [int(t) for t in ids]


def tokenize_prompt(tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a string, a token-id list or a vLLM prompt dict."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), token_ids_of(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "Text prompts need the tokenizer, which skip_tokenizer_init=True skips: give token ids "
                "(a list of ints or {'prompt_token_ids': [...]})."
            )
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        return None, token_ids_of(prompt)
    raise ValueError(f"A prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")


def check_logprobs(params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
    """Caps logprobs / prompt_logprobs at max_logprobs (-1: no cap) and resolves a request's -1 to
    the whole vocabulary, as vLLM: a -1 request counts as vocab_size against the cap."""
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is None:
            continue
        asked = vocab_size if k == -1 else k
        if asked > cap:
            raise ValueError(
                f"{name} must be at most max_logprobs ({max_logprobs}; a request's -1 means all {vocab_size} "
                f"tokens of the vocabulary), got {k}. Raise the engine's max_logprobs to allow more."
            )
        setattr(params, name, asked)


def truncate_prompt(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens ids (-1: max_model_len), or all of them."""
    k = params.truncate_prompt_tokens
    if k is None:
        return ids
    k = max_model_len if k == -1 else k
    return ids[-k:] if len(ids) > k else ids


def validate_prompt(
    ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int, kv: KVCacheManager
) -> None:
    """Raises ValueError if the prompt can never run; resolves max_tokens=None."""
    if not ids:
        raise ValueError("The prompt is empty: give at least one token.")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"Prompt token ids out of range [0, {vocab_size}): {bad[:5]}.")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"The prompt is {len(ids)} tokens long, but this model's maximum context length is "
            f"{max_model_len} tokens (prompt + at least one generated token must fit)."
        )
    if params.max_tokens is None:
        params.max_tokens = max_model_len - len(ids)
        if params.min_tokens > params.max_tokens:  # checked by SamplingParams only for an explicit max_tokens
            raise ValueError(
                f"min_tokens must be <= max_tokens ({params.max_tokens}: the rest of the context after a "
                f"{len(ids)}-token prompt), got {params.min_tokens}."
            )
    if len(ids) + params.max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} for the "
            f"completion). Reduce the prompt or max_tokens."
        )
    if not kv.can_ever_fit(len(ids) + params.max_tokens):
        raise ValueError(
            f"The request needs up to {len(ids) + params.max_tokens} tokens of KV cache, more than the whole "
            f"cache holds ({kv.num_blocks * kv.block_size} tokens). Raise kv_cache_memory_gib."
        )
