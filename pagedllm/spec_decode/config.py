"""``speculative_config``: vLLM's dict (``LLM(speculative_config={...})``) or JSON text
(``--speculative-config``), validated once at start-up.

Supported: ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
"prompt_lookup_min": m, "disable_by_batch_size": b}``. Everything else (a draft ``model``, other
methods, vLLM's other keys) is refused by name, so a config is never half honoured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SUPPORTED_METHODS = ("ngram",)
# vLLM's n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    # Speculate only while fewer sequences than this run (None: always), as vLLM's option.
    disable_by_batch_size: int | None = None
    method: str = "ngram"


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}.")
    return value


def parse_speculative_config(value: object) -> SpeculativeConfig | None:
    """The validated config of ``value`` (a dict, its JSON text, or None for no speculation).
    Raises ValueError naming what is wrong or not supported."""
    if value is None:
        return None
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict (JSON object), got {type(value).__name__}.")
    if value.get("model") is not None:
        raise ValueError(
            "speculative_config: draft models ('model') are not supported yet; use "
            '{"method": "ngram", "num_speculative_tokens": k}.'
        )
    method = value.get("method", "ngram")
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"speculative_config: method {method!r} is not supported; supported: {SUPPORTED_METHODS}.")
    unknown = sorted(k for k in value if k not in _KEYS and not (k == "model" and value[k] is None))
    if unknown:
        raise ValueError(f"speculative_config: {', '.join(unknown)} not supported; supported keys: {_KEYS}.")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: num_speculative_tokens is required.")
    k = _positive_int("num_speculative_tokens", value["num_speculative_tokens"])
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    lo = _positive_int("prompt_lookup_min", lo)
    hi = _positive_int("prompt_lookup_max", hi)
    if lo > hi:
        raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi}).")
    by_batch = value.get("disable_by_batch_size")
    if by_batch is not None:
        by_batch = _positive_int("disable_by_batch_size", by_batch)
    return SpeculativeConfig(k, hi, lo, by_batch, method)
