"""What the model runner keeps of each sequence between steps: its tokens, how to sample it, and
its random generator (so a seeded sequence draws the same tokens whatever its batch, and draws
on where it left off after a preemption)."""

from __future__ import annotations

import torch

from pagedllm.sampling_params import SamplingParams


class SeqState:
    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        seed: int | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.num_computed_tokens = 0
        # Return the logprobs of the prompt positions it runs (the scheduler says, each time it
        # sends the sequence whole: SamplingParams.prompt_logprobs, not all computed yet).
        self.wants_prompt_logprobs = False
        self.generator: torch.Generator | None = None
        seed = sampling_params.seed if seed is None else seed
        if seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(seed)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_logprobs(self) -> bool:
        """Whether its tokens' logprobs are computed: asked for (beam search asks), or needed to
        rank best_of > n candidates. Otherwise, as in vLLM, cumulative_logprob is None."""
        return self.sampling_params.needs_logprobs

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def reset_tokens(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.all_token_ids = list(token_ids)
        self.num_prompt_tokens = num_prompt_tokens
