"""One sequence as the scheduler and the KV managers see it: tokens, and how many have KV.

A user request is one sequence, or several (n > 1, best_of, beam search): those are built from
this one primitive by the group layer above the engine core (pagedllm/engine/groups.py,
pagedllm/engine/beam_group.py), which forks sequences that then share KV blocks.
"""

from __future__ import annotations

import enum
import hashlib
import time
from typing import TYPE_CHECKING

from pagedllm.logprobs import Logprob, PromptLogprobs
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.structured_output.manager import GrammarState


class SequenceStatus(enum.Enum):
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
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
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


class Sequence:
    """Prompt, generated tokens, and how much of it has KV in the cache.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. The tokens still to run
    through the model are ``all_token_ids[num_computed_tokens:]``: the prompt (in chunks) at
    first, then one generated token per step. Preemption by recompute sets it back to 0.

    A sequence samples its next token in the step that computes its last known token, once per
    length. With ``auto_append`` (the default) the scheduler appends the sampled token at once;
    otherwise (beam search) the sample is only reported and the sequence is idle, with nothing
    to run, until its owner appends the token it chooses (``append_token``).
    """

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        seed: int | None = None,
        auto_append: bool = True,
        cache_salt: bytes | None = None,
    ) -> None:
        """``cache_salt``: what besides its tokens decides its cached keys (the model's
        prefix_cache_salt): prefix-cache blocks are shared only between equal salts."""
        self.seq_id = seq_id
        self.cache_salt = cache_salt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        # SamplingParams.prompt_logprobs: one entry per prompt token so far (None for the first),
        # filled from the runner's outputs as the prompt's chunks run.
        self.prompt_logprobs: PromptLogprobs | None = [None] if sampling_params.prompt_logprobs is not None else None
        self.num_preemptions = 0
        # SamplingParams.structured_outputs: the matcher of its output (advanced as tokens append).
        self.grammar: GrammarState | None = None
        # The seed of this sequence's random draws (the runner keeps the generator).
        self.seed = sampling_params.seed if seed is None else seed
        self.auto_append = auto_append
        # Sequences forked from one another share blocks: the scheduler swaps them together.
        self.group_id: str | None = None
        self.sampled_at_len = -1  # the length at which it last sampled (once per length)
        # Seats under max_num_seqs held for sequences its owner will fork off it (n > 1: the
        # scheduler admits it only with room for them).
        self.reserved_seats = 0
        # How many of its tokens the model runner already holds (the scheduler sends the rest).
        self.num_tokens_sent = 0
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

    @property
    def is_idle(self) -> bool:
        """Sampled at its current length, waiting for its owner to append a token."""
        return not self.auto_append and self.sampled_at_len == self.num_tokens

    @property
    def waits_for_mask(self) -> bool:
        """Its structured-output mask for the next token is still being computed: the scheduler
        leaves it out of this step rather than make the step wait (structured_output/state.py)."""
        return self.grammar is not None and self.grammar.mask is None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keeps only the first ``num_output_tokens`` generated tokens: a stop string ended the
        sequence at a token of a speculated run, and the run's later tokens are not output."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not all in yet: its whole prompt must run through the
        model (no prefix-cache hits), since the logprobs come from each position's logits."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def add_prompt_logprobs(self, first: int, entries: list[dict[int, Logprob]]) -> None:
        """Entries for prompt tokens ``first``, ``first + 1``, ... from one step. A prompt run
        again (preempted by recompute) gives entries already held: those are kept."""
        if self.prompt_logprobs is None:
            return
        have = len(self.prompt_logprobs)
        assert first <= have, f"{self.seq_id}: prompt logprobs from {first} after only {have}"
        self.prompt_logprobs.extend(entries[have - first :])

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def fork(self, seq_id: str, num_tokens: int | None = None, seed: int | None = None) -> Sequence:
        """A new sequence holding this one's first ``num_tokens`` tokens (all if None).

        KV blocks and ``num_computed_tokens`` are the scheduler's and KV manager's business; the
        child starts with nothing computed.
        """
        n = self.num_tokens if num_tokens is None else num_tokens
        assert self.num_prompt_tokens <= n <= self.num_tokens, "a fork keeps the prompt"
        child = Sequence(
            seq_id,
            self.prompt_token_ids,
            self.sampling_params,
            arrival_time=self.arrival_time,
            seed=seed,
            auto_append=self.auto_append,
            cache_salt=self.cache_salt,
        )
        child.output_token_ids = list(self.output_token_ids[: n - self.num_prompt_tokens])
        child.all_token_ids = list(self.all_token_ids[:n])
        child.group_id = self.group_id
        if n == self.num_tokens:  # an idle parent's fork is idle too: its owner appends to both
            child.sampled_at_len = self.sampled_at_len
        child.num_cached_tokens = self.num_cached_tokens
        if self.prompt_logprobs is not None:  # the request's are its first sequence's: none to compute
            child.prompt_logprobs = list(self.prompt_logprobs)
        if self.grammar is not None:
            child.grammar = self.grammar.fork(child.output_token_ids)
        child.num_preemptions = self.num_preemptions
        child.first_scheduled_time = self.first_scheduled_time
        child.first_token_time = self.first_token_time
        child.last_token_time = self.last_token_time
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
