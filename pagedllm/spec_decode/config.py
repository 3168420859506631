"""``speculative_config``: vLLM's dict (``LLM(speculative_config={...})``) or JSON text
(``--speculative-config``), validated once at start-up.

Supported, in vLLM's keys:
- n-gram prompt lookup: ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
  "prompt_lookup_min": m, "disable_by_batch_size": b}``;
- a draft model: ``{"model": path_or_name, "num_speculative_tokens": k, "disable_by_batch_size": b}``,
  optionally with ``"method": "draft_model"``, the draft's ``"quantization"`` (as the engine's
  option; default "auto": the draft's own form) and ``"draft_tensor_parallel_size": 1``.
Everything else (other methods, vLLM's other keys) is refused by name, so a config is never half
honoured. What the engine cannot run with a given draft is refused when it loads (draft_load.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SUPPORTED_METHODS = ("ngram", "draft_model")
# vLLM's n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
_COMMON_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size")
_NGRAM_KEYS = (*_COMMON_KEYS, "prompt_lookup_max", "prompt_lookup_min")
_DRAFT_KEYS = (*_COMMON_KEYS, "model", "quantization", "draft_tensor_parallel_size")
_QUANTIZATIONS = ("auto", "gguf", "none", None)


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int = 0  # n-gram only
    prompt_lookup_min: int = 0
    # Speculate only while fewer sequences than this run (None: always), as vLLM's option.
    disable_by_batch_size: int | None = None
    method: str = "ngram"
    # method "draft_model": the draft's path or hub name, and its quantization (EngineConfig's values).
    model: str | None = None
    quantization: str | None = "auto"

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"


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
    draft = value.get("model")
    # vLLM infers the method from a draft model; "draft_model" is its explicit name for it.
    method = value.get("method") or ("draft_model" if draft is not None else "ngram")
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"speculative_config: method {method!r} is not supported; supported: {SUPPORTED_METHODS}.")
    keys = _DRAFT_KEYS if method == "draft_model" else _NGRAM_KEYS
    unknown = sorted(k for k in value if k not in keys and not (k == "model" and value[k] is None))
    if unknown:
        raise ValueError(
            f"speculative_config: {', '.join(unknown)} not supported with method {method!r}; supported keys: {keys}."
        )
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: num_speculative_tokens is required.")
    k = _positive_int("num_speculative_tokens", value["num_speculative_tokens"])
    by_batch = value.get("disable_by_batch_size")
    if by_batch is not None:
        by_batch = _positive_int("disable_by_batch_size", by_batch)
    if method == "draft_model":
        return _draft_config(value, k, by_batch)
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
    return SpeculativeConfig(k, hi, lo, by_batch, method)


def _draft_config(value: dict, k: int, by_batch: int | None) -> SpeculativeConfig:
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config: method 'draft_model' needs 'model', the draft's path or name.")
    tp = value.get("draft_tensor_parallel_size")
    if tp is not None and tp != 1:
        raise ValueError(
            f"speculative_config: draft_tensor_parallel_size={tp!r} is not supported: the draft runs unsharded (1)."
        )
    quant = value.get("quantization", "auto")
    if isinstance(quant, str):
        quant = quant.lower()
    if quant not in _QUANTIZATIONS:
        raise ValueError(f"speculative_config: quantization must be one of {_QUANTIZATIONS}, got {quant!r}.")
    return SpeculativeConfig(
        k,
        disable_by_batch_size=by_batch,
        method="draft_model",
        model=model,
        quantization=None if quant == "none" else quant,
    )
