"""EngineCore: the step loop over sequences, scheduler and runner joined by their plain-data
contract. Requests, groups (n > 1, beams), detokenization and outputs live above it (LLMEngine).

    SchedulerOutput = scheduler.schedule()           # plain data: ids, counts, blocks, block ops
    ModelRunnerOutput = runner.execute(it)           # the runner's own state + the forward + sampling
    samples = scheduler.update_from_output(both)     # append, stop checks, free, prefix cache

Its primitives are the ones the group layer builds on: add a sequence, fork one (the child
shares the parent's KV blocks, copy-on-write), append a token an owner chose, finish one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from pagedllm.runner.model_runner import ModelRunner
from pagedllm.scheduler import SampledToken, Scheduler
from pagedllm.scheduler_output import GrammarBitmask, SchedulerOutput
from pagedllm.sequence import Sequence, SequenceStatus
from pagedllm.structured_output.manager import StructuredOutputManager

# How long a step waits for structured-output masks still being computed: a tenth of a step's
# forward, at most 2 ms, so that cheap masks (well under a millisecond) make the step while an
# expensive one costs everyone else at most that; a step with nothing else to run waits up to
# MASK_IDLE_WAIT_S for one (then the engine thread looks at its commands again). Measured on the
# default model under 4 clients of a 12,000-string choice: a quarter of a step (capped at 10 ms)
# slowed a concurrent request 2.5x, no wait 1.6x.
MASK_GRACE_FRACTION = 0.1
MASK_GRACE_MAX_S = 0.002
MASK_IDLE_WAIT_S = 0.010


class EngineCore:
    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, structured: StructuredOutputManager | None = None
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.structured = structured
        # Called with every SchedulerOutput before the runner executes it (benchmarks sample
        # KV memory there: the memory the step runs with).
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None
        self.num_steps = 0  # steps that ran the model
        # tokens one step ran -> how many steps ran that many (vLLM's iteration_tokens_total);
        # at most max_num_batched_tokens keys
        self.iteration_tokens: dict[int, int] = {}
        # The sequences the latest step scheduled (set before the runner runs, so also after it raised).
        self.last_scheduled: list[str] = []
        self._step_seconds = 0.0  # moving average of a step's forward, for the mask grace

    def add_seq(self, seq: Sequence) -> None:
        self.scheduler.add_seq(seq)

    def fork_seq(
        self, parent: Sequence, child_id: str, num_tokens: int | None = None, seed: int | None = None
    ) -> Sequence:
        """A new sequence holding ``parent``'s first ``num_tokens`` tokens (all if None), sharing
        its blocks. A child left with nothing to run runs its last token again and so samples
        its own next token (n > 1 forks at the prompt)."""
        child = parent.fork(child_id, num_tokens, seed)
        self.scheduler.fork_seq(parent, child)
        return child

    def append_token(self, seq: Sequence, token_id: int) -> None:
        self.scheduler.append_token(seq, token_id)

    def finish_seq(self, seq_id: str, status: SequenceStatus) -> None:
        self.scheduler.finish_seq(seq_id, status)

    def has_unfinished_seqs(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def step(self, only: Collection[str] | None = None) -> list[SampledToken]:
        """One step. ``only``: schedule none but these sequences this step (running ones; the rest
        keep their blocks and places and are not admitted, swapped in or preempted), so that a
        step that raised can be retried without the sequence that made it raise."""
        structured = self.structured
        if structured is not None and structured.has_pending:
            # Masks computed since the last step come in; the rest get a fraction of a step's
            # time, then their sequences sit this step out (Sequence.waits_for_mask).
            structured.settle(min(MASK_GRACE_MAX_S, MASK_GRACE_FRACTION * self._step_seconds))
        self.last_scheduled = []  # stays empty if schedule() itself raises
        sched = self.scheduler.schedule() if only is None else self.scheduler.schedule_only(set(only))
        self.last_scheduled = list(sched.num_scheduled_tokens)
        sched.grammar_bitmask = self._grammar_bitmask(sched)
        if self.on_schedule is not None:
            self.on_schedule(sched)
        start = time.perf_counter()
        try:
            sampled = self.runner.execute(sched)
        except BaseException:
            self.scheduler.on_step_failed(sched)
            raise
        if not sched.is_empty:
            self.num_steps += 1
            n = sched.total_num_scheduled_tokens
            self.iteration_tokens[n] = self.iteration_tokens.get(n, 0) + 1
            self._step_seconds += 0.25 * (time.perf_counter() - start - self._step_seconds)
        elif structured is not None and structured.has_pending:
            structured.wait_any(MASK_IDLE_WAIT_S)  # only masks to wait for: no busy loop
        return self.scheduler.update_from_output(sched, sampled)

    def _grammar_bitmask(self, sched: SchedulerOutput) -> GrammarBitmask | None:
        """The masks of the constrained sequences that sample this step (their last known token
        runs): one row each, or one per position run for a speculating one."""
        if self.structured is None:
            return None
        seqs = self.scheduler.seqs
        ids, num_drafts = [], []
        for seq_id, n in sched.num_scheduled_tokens.items():
            seq = seqs.get(seq_id)
            if seq is not None and seq.grammar is not None and seq.grammar.constrains:
                drafts = sched.spec_token_ids.get(seq_id)
                if drafts is not None or seq.num_computed_tokens + n == seq.num_tokens:
                    ids.append(seq_id)
                    num_drafts.append(0 if drafts is None else len(drafts))
        if not ids:
            return None
        mask = self.structured.bitmask([seqs[i].grammar for i in ids], num_drafts)
        first_rows = [sum(num_drafts[:j]) + j for j in range(len(ids))]
        return GrammarBitmask(dict(zip(ids, first_rows, strict=True)), mask)
