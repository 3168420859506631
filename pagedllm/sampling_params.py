"""SamplingParams: per-request generation settings, with vLLM's field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request. Field names, defaults and meaning follow vLLM.

    temperature == 0 means greedy. ``top_k`` of 0 or -1 disables top-k. Penalties follow vLLM:
    presence/frequency penalties count generated tokens only; repetition_penalty (HF/CTRL style)
    counts prompt and generated tokens. ``seed`` makes one request reproducible whatever else is
    in the batch.
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
    # Filled by the engine: token ids that end generation besides stop_token_ids (the model's EOS).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False, compare=False)
    # Set by beam search: logprobs are reported for the distribution scaled by this temperature
    # (its candidates are scored by them); 1.0 is the raw model distribution.
    logprob_temperature: float = field(default=1.0, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def bad(field_name: str, msg: str) -> ValueError:
            value = getattr(self, field_name)
            return ValueError(f"{field_name} {msg}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            raise bad("best_of", f"must be an integer >= n ({self.n})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be -1/0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be an integer >= 0")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")

    @property
    def needs_logprobs(self) -> bool:
        """Whether sampled tokens' logprobs are computed: asked for, or needed to rank best_of > n
        candidates. Otherwise, as in vLLM, cumulative_logprob is None."""
        return self.logprobs is not None or (self.best_of or self.n) > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
