"""The state of one request (one sequence) as the scheduler and engine see it."""

from __future__ import annotations

import enum
import time

import torch

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """One sequence: prompt, generated tokens, and how much of it has KV in the cache.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. The tokens still to run
    through the model are ``all_token_ids[num_computed_tokens:]``: the prompt (in chunks) at
    first, then one generated token per step. Preemption by recompute sets it back to 0.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        # Per-request RNG so a seeded request samples the same tokens whatever its batch.
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(sampling_params.seed)
        # Timing, for metrics.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        # max_tokens=None is resolved by the engine (to max_model_len - prompt) before scheduling.
        assert self.sampling_params.max_tokens is not None
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
