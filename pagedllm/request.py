"""The state of one request (one sequence) as the scheduler and engine see it."""

from __future__ import annotations

import enum
import hashlib
import time

import torch

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"  # preempted by swapping: its KV blocks wait in host memory
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


def child_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of a request with ``n`` > 1 (or ``best_of``) and ``seed``.

    Sequence 0 keeps the request's seed, so it draws exactly what an n=1 request with that seed
    draws; the others get a stable 63-bit hash of (seed, index), so the whole group is
    reproducible, and sequence i equals an n=1 request with seed ``child_seed(seed, i)``.
    """
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Request:
    """One sequence: prompt, generated tokens, and how much of it has KV in the cache.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. The tokens still to run
    through the model are ``all_token_ids[num_computed_tokens:]``: the prompt (in chunks) at
    first, then one generated token per step. Preemption by recompute sets it back to 0.

    A request with n > 1 (parallel sampling) or a beam search is a group of such sequences that
    share KV blocks: ``group_id`` names the group (the user's request id), ``index`` the sequence
    within it. ``request_id`` is unique per sequence (the scheduler's and KV manager's key).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        seed: int | None = None,
        group_id: str | None = None,
        index: int = 0,
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
        seed = sampling_params.seed if seed is None else seed
        if seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(seed)
        # ---- sharing (n > 1, beam search) --------------------------------------------------
        self.group_id = group_id
        self.index = index
        # Sequences that are drawn from this one's first sampled distribution and then forked
        # off it (sharing its prompt blocks): the sampler draws one token for each of them too.
        self.fork_children: list[Request] = []
        self.fork_parent: Request | None = None
        # How many sequences this request may grow by at its next sample (n - 1 for a fresh
        # parallel-sampling request, beam_width - 1 for a beam search's prompt): the scheduler
        # admits it only with room for them under max_num_seqs.
        self.num_pending_seqs = 0
        # True while its group decides what its next token is (beam search: all beams' candidates
        # are needed first). A blocked request has nothing to run: the scheduler neither runs nor
        # admits it until the group appends a token.
        self.blocked = False
        # Logprobs are reported for the distribution scaled by this temperature (beam search
        # scores candidates by them); 1.0 is the raw model distribution, as for plain requests.
        self.logprob_temperature = 1.0
        # Timing, for metrics.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def needs_logprobs(self) -> bool:
        """Whether its tokens' logprobs are computed: asked for (beam search asks), or needed to
        rank best_of > n candidates. Otherwise, as in vLLM, cumulative_logprob is None."""
        sp = self.sampling_params
        return sp.logprobs is not None or (sp.best_of or sp.n) > sp.n

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

    def fork(self, request_id: str, index: int) -> Request:
        """A new sequence with this one's tokens and scores so far (beam search's child beam).

        KV blocks and ``num_computed_tokens`` are the scheduler's and KV manager's business; the
        child starts with nothing computed. The random generator is not shared (beams are greedy).
        """
        child = Request(
            request_id,
            self.prompt_token_ids,
            self.sampling_params,
            prompt=self.prompt,
            arrival_time=self.arrival_time,
            group_id=self.group_id,
            index=index,
        )
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.num_cached_tokens = self.num_cached_tokens
        child.num_preemptions = self.num_preemptions
        child.logprob_temperature = self.logprob_temperature
        child.first_scheduled_time = self.first_scheduled_time
        child.first_token_time = self.first_token_time
        child.last_token_time = self.last_token_time
        return child

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
