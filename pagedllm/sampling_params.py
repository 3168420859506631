"""SamplingParams: per-request generation settings, with vLLM's field names and defaults."""

from __future__ import annotations

import copy
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any

# Importable from here as from vLLM's sampling_params module.
from pagedllm.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams"]

_GREEDY_EPS = 1e-5
# OpenAI's range. Above it sampling is uniform noise anyway; the bound keeps nonsense such as 1e39 out.
MAX_TEMPERATURE = 2.0
# Dividing logits by a penalty below this (or multiplying by one above the upper bound) overflows
# float32 logits to +-inf and the softmax to NaN.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 1000.0
# Integer fields end up in int32/int64 tensors and loops; anything larger is a mistake or an attack.
MAX_INT_FIELD = 2**31 - 1
# OpenAI's range for logit_bias values: -100 bans a token in practice, +100 forces it.
MAX_LOGIT_BIAS = 100.0

_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxlist, _REPR.maxother = 40, 6, 40


@dataclass
class SamplingParams:
    """How to sample one request. Field names, defaults and meaning follow vLLM.

    temperature == 0 means greedy. ``top_k`` of 0 or -1 disables top-k. Penalties follow vLLM:
    presence/frequency penalties count generated tokens only; repetition_penalty (HF/CTRL style)
    counts prompt and generated tokens. ``seed`` makes one request reproducible whatever else is
    in the batch.

    ``logprobs`` / ``prompt_logprobs``: how many top tokens per position besides the chosen (or
    prompt) token; -1 means the whole vocabulary. The engine caps both at its ``max_logprobs``.
    Token controls, applied to the logits before the penalties (vLLM's order): ``allowed_token_ids``
    (every other token is masked), ``bad_words`` (see pagedllm/token_controls.py) and
    ``logit_bias`` (token id -> value in [-100, 100] added to its logit). ``truncate_prompt_tokens``
    keeps the prompt's last k tokens (-1: the last max_model_len).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The output must match this (JSON schema, regex, choice, grammar): see pagedllm.structured_output.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's earlier name for structured_outputs (its GuidedDecodingParams): moved there.
    guided_decoding: StructuredOutputsParams | None = field(default=None, repr=False, compare=False)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # Filled by the engine: token ids that end generation besides stop_token_ids (the model's EOS).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False, compare=False)
    # Set by beam search: logprobs are reported for the distribution scaled by this temperature
    # (its candidates are scored by them); 1.0 is the raw model distribution.
    logprob_temperature: float = field(default=1.0, repr=False, compare=False)
    # Filled by the engine from bad_words and its tokenizer: the token sequences to ban.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    # Filled by the engine as it admits the request: allowed_token_ids and logit_bias as tensors
    # (pagedllm.token_controls.TokenMasks), built once and shared by the request's sequences.
    token_masks: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias)
        if isinstance(self.allowed_token_ids, (list, tuple)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif isinstance(self.bad_words, (list, tuple)):
            self.bad_words = list(self.bad_words)
        if self.top_k == -1:
            self.top_k = 0
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("Give structured_outputs or guided_decoding (its earlier name), not both.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.structured_outputs = _structured(self.structured_outputs)
        self._verify()

    def _verify(self) -> None:
        def bad(field_name: str, msg: str) -> ValueError:
            # Bounded: the value may be a list of a million stop strings.
            return ValueError(f"{field_name} {msg}, got {_REPR.repr(getattr(self, field_name))}.")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def finite(field_name: str) -> None:
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(field_name, "must be a finite number")

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            finite(name)
        # n and best_of are bounded by the engine (max_num_seqs), which says so in its message.
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            raise bad("best_of", f"must be an integer >= n ({self.n})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be >= 0 and <= {MAX_TEMPERATURE:g}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT_FIELD:
            raise bad("top_k", "must be -1/0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT_FIELD):
            raise bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_INT_FIELD:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not is_int(self.logprobs) or not -1 <= self.logprobs <= MAX_INT_FIELD):
            raise bad("logprobs", "must be an integer >= 0, or -1 (the whole vocabulary)")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not -1 <= self.prompt_logprobs <= MAX_INT_FIELD
        ):
            raise bad("prompt_logprobs", "must be an integer >= 0, or -1 (the whole vocabulary)")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not is_int(t) or not 0 <= t <= MAX_INT_FIELD for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        self._verify_token_controls(bad, is_int)

    def _verify_token_controls(self, bad, is_int) -> None:
        """Shapes and ranges; token ids against the vocabulary are the engine's to check."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            for t, v in self.logit_bias.items():
                if not is_int(t) or not 0 <= t <= MAX_INT_FIELD:
                    raise bad("logit_bias", "keys must be token ids (non-negative integers)")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                    raise bad("logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids:
                raise bad("allowed_token_ids", "must be a non-empty list of token ids")
            if any(not is_int(t) or not 0 <= t <= MAX_INT_FIELD for t in ids):
                raise bad("allowed_token_ids", "must be token ids (non-negative integers)")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words
            ):
                raise bad("bad_words", "must be a list of non-blank strings")
        k = self.truncate_prompt_tokens
        if k is not None and (not is_int(k) or not (k == -1 or 1 <= k <= MAX_INT_FIELD)):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 (the last max_model_len tokens)")

    @property
    def needs_logprobs(self) -> bool:
        """Whether sampled tokens' logprobs are computed: asked for, or needed to rank best_of > n
        candidates. Otherwise, as in vLLM, cumulative_logprob is None."""
        return self.logprobs is not None or (self.best_of or self.n) > self.n

    @property
    def has_token_controls(self) -> bool:
        """Whether the sampler edits this request's logits before the penalties (token_controls.py)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        """A copy the engine may fill in (max_tokens, all_stop_token_ids) without touching the caller's.

        Shallow, with fresh containers: the fields hold only immutable values (numbers, strings)
        inside them, and a deep copy per prompt of a request with many stop strings was needlessly
        slow.
        """
        c = copy.copy(self)
        c.stop = list(self.stop)
        c.stop_token_ids = list(self.stop_token_ids)
        c.all_stop_token_ids = set(self.all_stop_token_ids)
        c.token_masks = None  # built from the fields, which the copy's owner may change
        if self.logit_bias is not None:
            c.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            c.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            c.bad_words = list(self.bad_words)
        return c


def _structured(value: Any) -> StructuredOutputsParams | None:
    """StructuredOutputsParams from itself or its fields as a dict (vLLM takes the object only)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        try:
            return StructuredOutputsParams(**value)
        except TypeError as e:
            raise ValueError(f"structured_outputs: {e}") from e
    raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(value).__name__}.")
