"""An OpenAI request's sampling fields -> the engine's SamplingParams, with 400s naming the field.

Apart from the request shapes (protocol.py) because this is where a request meets the engine:
the model's generation defaults fill what the request left out, and the bounds checked here
(n, best_of, seed) protect the engine rather than describe the wire format.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.errors import APIError, error_from_value_error, short_repr
from pagedllm.entrypoints.openai.protocol import _SamplingRequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

MAX_N = 128
_FIELDS = set(SamplingParams.__dataclass_fields__)


def to_sampling_params(
    req: _SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None,
    best_of: int | None = None,
    prompt_logprobs: int | None = None,
    defaults: dict[str, Any] | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Builds SamplingParams; omitted (None) fields take ``defaults`` (the model's generation config,
    see generation_defaults.py), else SamplingParams' (vLLM's) defaults. A default max_tokens caps
    the request's, as vLLM's max_new_tokens does.

    Raises APIError(400) naming the bad field. How many logprobs a request may ask for is the
    engine's max_logprobs, checked when the request is added.
    """
    defaults = defaults or {}
    default_max = defaults.get("max_tokens")
    if default_max is not None:
        max_tokens = default_max if max_tokens is None else min(max_tokens, default_max)
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise APIError(f"n must be between 1 and {MAX_N}, got {n}.", param="n")
    # Bounded here because the engine creates best_of sequences at once: 2**64 would hang it.
    if best_of is not None and not n <= best_of <= MAX_N:
        raise APIError(f"best_of must be between n ({n}) and {MAX_N}, got {best_of}.", param="best_of")
    if best_of is not None and best_of > n and req.stream:
        raise APIError("best_of > n cannot be streamed: the best n are only known at the end.", param="best_of")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise APIError(f"seed must fit in 64 bits, got {req.seed}.", param="seed")
    kwargs: dict[str, Any] = {
        "n": n,
        "best_of": best_of,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "min_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "logit_bias": _logit_bias(req.logit_bias),
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words": req.bad_words,
        "truncate_prompt_tokens": req.truncate_prompt_tokens,
        "structured_outputs": structured_outputs,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if kwargs[name] is None and name in defaults:
            kwargs[name] = defaults[name]
    # max_tokens=None is meaningful (the rest of the context); every other None means "default".
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in ("max_tokens", "logprobs", "best_of")}
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise error_from_value_error(e, _FIELDS) from e


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if bias is None:
        return None
    out = {}
    for k, v in bias.items():
        try:
            out[int(k)] = v
        except ValueError:
            raise APIError(
                f"logit_bias keys must be token ids (integers as strings), got {short_repr(k)}.", param="logit_bias"
            ) from None
    return out
