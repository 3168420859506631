"""Request outputs returned by the offline API and streamed by the server (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

# One dict per generated token: token id -> logprob, holding the chosen token and the top-N.
SampleLogprobs = list[dict[int, float]]
# One entry per prompt token (SamplingParams.prompt_logprobs): None for the first, which nothing
# predicts; then token id -> logprob of that position's prompt token and the top-N, given the
# prompt before it.
PromptLogprobs = list[dict[int, float] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended generation

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # None unless SamplingParams.prompt_logprobs is set
