"""Request outputs returned by the offline API and streamed by the server (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.logprobs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = ["CompletionOutput", "Logprob", "PromptLogprobs", "RequestOutput", "SampleLogprobs"]


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
