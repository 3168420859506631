"""Which sequences speculate in a step, with how many drafts (n-gram: which drafts; with a draft
model only how many: the runner's draft model proposes them), and the counters of what came of it.

A sequence speculates only where the target's token at each drafted position is decided by that
position's logits alone (and its grammar's state there), the same as without speculation:
- it is decoding (one known token left to run: chunked prefill finishes first);
- its tokens are appended as sampled (not beam search, whose owner picks them);
- it is greedy, or it samples without asking for logprobs (rejection sampling: the runner
  returns no logprobs for its drafted positions);
- it has no bad_words, no repetition / frequency / presence penalty, and min_tokens is reached:
  each of those depends on the tokens before the position, and the runner's verifying pass sees
  only the sequence's tokens before the drafts.
A sequence with a structured-output grammar speculates too, with n-gram drafts: they are walked
through the grammar without committing (GrammarState.propose), cut at the first one it forbids
(that one could never be accepted), and each verifying position is masked with the grammar's
state after the drafts before it, so the target's distribution there is the masked one, as
without speculation; the grammar then advances over exactly the tokens kept. A draft model's
drafts are proposed in the runner, where no grammar is: with one, constrained sequences do not
speculate.
Drafts never run past max_tokens, max_model_len or the step's token budget, and nobody
speculates while ``disable_by_batch_size`` or more sequences run.
"""

from __future__ import annotations

from pagedllm.kv.base import KVCacheManager
from pagedllm.scheduler_output import SchedulerOutput
from pagedllm.sequence import Sequence
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import propose_ngram
from pagedllm.utils import cdiv


def can_speculate(seq: Sequence) -> bool:
    sp = seq.sampling_params
    return (
        seq.auto_append
        and (sp.greedy or not sp.needs_logprobs)
        and not sp.bad_words_token_ids
        and sp.repetition_penalty == 1.0
        and not sp.frequency_penalty
        and not sp.presence_penalty
        and seq.num_output_tokens >= sp.min_tokens
    )


def constrain_drafts(seq: Sequence, drafts: list[int]) -> list[int]:
    """``drafts`` cut to the leading ones ``seq``'s grammar allows (all of them without one); the
    grammar keeps the mask of each verifying position for the runner (GrammarState.propose)."""
    if seq.grammar is None or not drafts:
        return drafts
    return seq.grammar.propose(drafts)


class SpecDecodePlanner:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # vLLM's counters: verifying passes with drafts, drafts proposed, drafts accepted, and
        # drafts accepted at each draft position (index i: the (i + 1)-th draft).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def max_drafts(self, seq: Sequence, budget: int, num_running: int) -> int:
        """How many drafts ``seq`` may run after its last token this step (0: it does not speculate)."""
        cfg = self.config
        if cfg.disable_by_batch_size is not None and num_running >= cfg.disable_by_batch_size:
            return 0
        if seq.num_tokens - seq.num_computed_tokens != 1 or not can_speculate(seq):
            return 0
        # A draft model's proposals cannot follow a grammar: the scheduler never sees them.
        if cfg.uses_draft_model and seq.grammar is not None:
            return 0
        # The step yields up to k + 1 tokens: drafts past the last one max_tokens allows, or past
        # the context, could never be kept.
        k = min(
            cfg.num_speculative_tokens,
            budget - 1,
            seq.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens,
        )
        return max(k, 0)

    def drafts(self, seq: Sequence, budget: int, num_running: int) -> list[int]:
        """The n-gram draft tokens ``seq`` runs after its last token this step ([]: none)."""
        cfg = self.config
        k = self.max_drafts(seq, budget, num_running)
        if k < 1:
            return []
        drafts = propose_ngram(seq.all_token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        return constrain_drafts(seq, drafts)

    def schedule(
        self, out: SchedulerOutput, seq: Sequence, kv: KVCacheManager, budget: int, running: list[Sequence], index: int
    ) -> bool:
        """Schedules ``seq`` (``running[index]``) with drafts after its last token, if it speculates
        this step and its lookahead slots fit while leaving a block for each running sequence
        after it: lookahead never preempts anyone, it is only worth doing with memory to spare.
        False: schedule it as usual."""
        if self.config.uses_draft_model:  # the runner's draft model proposes them
            drafts = None
            k = self.max_drafts(seq, budget, len(running))
        else:
            drafts = self.drafts(seq, budget, len(running))
            k = len(drafts)
        num_after = len(running) - index - 1
        if k < 1:
            return False
        n = 1 + k
        if kv.num_free_blocks() < num_after + cdiv(n, kv.block_size) + 1 or not kv.allocate_slots(seq, n):
            return False
        out.num_scheduled_tokens[seq.seq_id] = n
        if drafts is None:
            out.num_model_drafts[seq.seq_id] = k
        else:
            out.spec_token_ids[seq.seq_id] = drafts
        return True

    def verified(self, seq: Sequence, kv: KVCacheManager, num_drafts: int, num_accepted: int, num_kept: int) -> int:
        """After ``seq``'s verifying pass: K/V is valid for its last token and the accepted drafts it
        kept (the first ``num_kept`` positions run; fewer than 1 + ``num_accepted`` when a stop cut
        the run). Advances its computed count over them, gives back the slots past them, registers
        its verified full blocks; returns the length of its block table after."""
        self.record(num_drafts, num_accepted)
        seq.num_computed_tokens += num_kept
        num_blocks = kv.trim_to_computed(seq)
        kv.cache_computed_blocks(seq)
        kv.release_out_of_window(seq)
        return num_blocks

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verified run: ``num_drafts`` proposed, its first ``num_accepted`` accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def stats(self) -> dict[str, object]:
        """The counters under LLMEngine.get_stats()'s keys (exported with vLLM's names)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }
