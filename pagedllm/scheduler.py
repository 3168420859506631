"""Continuous batching: which sequences run this step, and how many tokens each.

Every step, running sequences go first (their next decode token, or their next prefill chunk),
then swapped-out sequences come back, then waiting sequences are admitted in arrival order while
the token budget (max_num_batched_tokens), the sequence limit (max_num_seqs) and free KV blocks
allow. A long prompt is split into chunks across steps (chunked prefill).

Preemption. When a running sequence cannot get a block, the youngest running sequence is
preempted, by one of two mechanisms (``preemption_mode``):
- "recompute" (default): its blocks are freed and it goes back to the front of the queue, to be
  prefilled again (prompt + what it generated) later, losing nothing but time;
- "swap": its blocks are copied to the host-memory pool and freed on the device; it comes back
  (blocks copied back) before anything new is admitted. Sequences of one group (forks sharing
  blocks: n > 1, beam search) are swapped out together, so blocks they share are copied once and
  stay shared. When the host pool is full, preemption falls back to recompute;
- "auto": swap for sequences of a group, whose shared blocks recompute would duplicate, and
  recompute for the rest (on a CPU device a swap is a memory-to-memory copy and recomputing a
  prompt is about as fast, without the host pool's memory).

Idle sequences (sampled, waiting for their owner to append a token: beam search) have nothing to
run and are not admitted. If nothing runs while others wait and every running sequence is idle,
the youngest is preempted to let the others in (else a group could wait forever for a member
that does not fit). A running sequence whose structured-output mask is still being computed
(Sequence.waits_for_mask) sits the step out, keeping its blocks and place.

The scheduler decides and records; it never touches tensors. ``schedule()`` returns a
SchedulerOutput of plain data for the runner (what changed since the runner was last told:
scheduler_sync.py); ``update_from_output()`` takes what the runner sampled, appends tokens,
checks stops and frees finished sequences.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.kv.base import KVCacheManager
from pagedllm.logprobs import Logprob
from pagedllm.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.scheduler_sync import RunnerSync
from pagedllm.sequence import Sequence, SequenceStatus
from pagedllm.spec_decode.planner import SpecDecodePlanner
from pagedllm.stop import check_stop


@dataclass
class SampledToken:
    """One sequence's sample from a step, as update_from_output reports it."""

    seq: Sequence
    token_id: int
    logprob: float | None
    top_logprobs: dict[int, Logprob] | None
    appended: bool  # False for a sequence whose owner appends (it is idle now)
    finished: SequenceStatus | None  # set when the token ended the sequence
    # Its index in the sequence's output (appended tokens only): a stop string found at an
    # earlier token of the same speculated run cuts the output, and discards this sample.
    output_index: int | None = None

    @property
    def discarded(self) -> bool:
        return self.output_index is not None and self.output_index >= self.seq.num_output_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Swapped-out units (a sequence, or the sequences of one group swapped together), oldest first.
        self.swapped: deque[list[Sequence]] = deque()
        self.seqs: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of num_preemptions, those by swapping
        self.runner_sync = RunnerSync(kv_manager)  # what the runner holds of each sequence
        spec = config.speculative
        self.spec = SpecDecodePlanner(spec, max_model_len) if spec is not None else None

    # ---- queue management ----------------------------------------------------------------
    def add_seq(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.seqs[seq.seq_id] = seq

    def finish_seq(self, seq_id: str, status: SequenceStatus) -> Sequence | None:
        """Ends a sequence (stop, length, abort): its blocks are free for the very next step."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            unit = self._unit_of(seq)
            unit.remove(seq)
            if not unit:
                self.swapped.remove(unit)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self.runner_sync.finished(seq_id)
        seq.status = status
        seq.finished_time = time.monotonic()
        return seq

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Adds ``child`` (holding a prefix of ``parent``'s tokens) beside its parent, sharing its
        blocks (copy-on-write).

        A parent on the device or swapped out shares its blocks (the child lands in the same
        place, right after it: groups stay together). A child that would hold all its tokens
        computed runs its last one again, so that it samples its own next token. A parent
        without blocks (preempted by recompute), or a manager that cannot share, gives a child
        that recomputes its tokens.
        """
        self.seqs[child.seq_id] = child
        if parent.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED) and self.kv.fork(parent, child):
            child.num_computed_tokens = min(parent.num_computed_tokens, child.num_tokens)
            if child.num_computed_tokens == child.num_tokens and not child.is_idle:
                child.num_computed_tokens -= 1
            child.status = parent.status
            if parent.status == SequenceStatus.RUNNING:
                self.running.insert(self.running.index(parent) + 1, child)
            else:
                unit = self._unit_of(parent)
                unit.insert(unit.index(parent) + 1, child)
            return
        child.num_computed_tokens = 0
        child.status = SequenceStatus.WAITING
        if parent in self.waiting:
            self.waiting.insert(self.waiting.index(parent) + 1, child)
        else:
            self.waiting.appendleft(child)  # as old as its parent: ahead of later arrivals

    def append_token(self, seq: Sequence, token_id: int) -> None:
        """The owner's choice of an idle sequence's next token (beam search)."""
        seq.append_output_token(token_id)

    def _unit_of(self, seq: Sequence) -> list[Sequence]:
        for unit in self.swapped:
            if any(r is seq for r in unit):
                return unit
        raise KeyError(seq.seq_id)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.seqs)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return sum(len(u) for u in self.swapped)

    # ---- the decision --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()
        preempted: list[Sequence] = []

        # 1. Running sequences, oldest first: each gets its remaining tokens (1 when decoding).
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0 or seq.waits_for_mask:
                i += 1  # idle: its owner has not appended its next token yet; or its mask is not in
                continue
            if self.spec is not None and self.spec.schedule(out, seq, self.kv, budget, self.running, i):
                budget -= out.num_scheduled_tokens[seq.seq_id]
                i += 1
                continue
            passed = None  # running[:i] as it was, once a preemption may change the indices
            preempted_self = False
            while not self.kv.allocate_slots(seq, num_new):
                if passed is None:
                    passed = self.running[:i]
                victims = self._preempt_youngest(out.num_scheduled_tokens, seq)
                preempted.extend(victims)
                if seq in victims:
                    preempted_self = True
                    break
            if passed is not None:
                # A swapped group may have taken idle members from before seq, too.
                i = sum(1 for r in passed if r.status == SequenceStatus.RUNNING)
            if not preempted_self:
                out.num_scheduled_tokens[seq.seq_id] = num_new
                budget -= num_new
                i += 1

        # 2 and 3. Swapped-out sequences come back, then waiting ones are admitted (not in a step
        #    that had to preempt: memory is short, admitting more would only preempt again).
        admit = not preempted
        while True:
            if admit:
                budget = self._swap_in(out, budget)
                if not any(not all(r.is_idle for r in u) for u in self.swapped):
                    budget = self._admit(out, budget, now)
            # Nothing runs, yet sequences wait, and every running one is idle: preempt the
            # youngest to let the others in. (A sequence swapped in but not yet given its slots
            # is not idle: it runs next step.)
            if (
                out.num_scheduled_tokens
                or not self.running
                or not self._has_runnable_outside()
                or any(r.num_computed_tokens < r.num_tokens for r in self.running)
            ):
                break
            preempted.extend(self._preempt_youngest(out.num_scheduled_tokens, None))
            admit = True
        out.block_ops = self.kv.take_block_ops()
        self.runner_sync.describe(out, self.seqs)
        return out

    def schedule_only(self, only: set[str]) -> SchedulerOutput:
        """schedule() over a subset of the running sequences (to retry a step that raised without
        the sequence that made it raise): the others, the waiting and the swapped-out queues are
        out of its sight for this call and put back after it, in order (sequences it preempted go
        ahead of the waiting, as schedule() puts them)."""
        running, waiting, swapped = self.running, self.waiting, self.swapped
        self.running = [r for r in running if r.seq_id in only]
        self.waiting, self.swapped = deque(), deque()
        try:
            return self.schedule()
        finally:
            still = {id(r) for r in self.running}
            self.running = [r for r in running if r.seq_id not in only or id(r) in still]
            self.waiting = deque([*self.waiting, *waiting])
            self.swapped = deque([*swapped, *self.swapped])

    def _has_runnable_outside(self) -> bool:
        return any(not r.is_idle for r in self.waiting) or any(not r.is_idle for u in self.swapped for r in u)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        for unit in list(self.swapped):
            if budget <= 0:
                break
            if all(r.is_idle for r in unit):
                continue  # nothing to run until its owner decides: stays in host memory
            if self.running and len(self.running) + len(unit) > self.config.max_num_seqs:
                break
            # Leave a block per sequence free, so they can take their next token at once; with
            # nothing else on the device, no margin (the unit fitted when it was swapped out).
            if not self.kv.swap_in(unit, reserve=len(unit) if self.running else 0):
                break
            self.swapped.remove(unit)
            for r in unit:
                r.status = SequenceStatus.RUNNING
                self.running.append(r)
            for r in unit:
                num_new = min(r.num_tokens - r.num_computed_tokens, budget)
                if num_new > 0 and self.kv.allocate_slots(r, num_new):
                    out.num_scheduled_tokens[r.seq_id] = num_new
                    budget -= num_new
        return budget

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        idx = 0
        while idx < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[idx]
            if seq.is_idle:
                idx += 1  # its owner has not appended its next token yet
                continue
            # A sequence its owner will fork (n > 1) needs room for the sequences to come.
            if self.running and len(self.running) + 1 + seq.reserved_seats > self.config.max_num_seqs:
                break
            # Prompt logprobs come from every prompt position's logits: such a prompt runs whole.
            cached = [] if seq.needs_prompt_logprobs else self.kv.find_cached_prefix(seq)
            num_computed = len(cached) * self.kv.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            if not self.kv.allocate_slots(seq, num_new, cached):
                break  # FCFS: nobody overtakes the head of the queue
            del self.waiting[idx]
            if seq.num_preemptions == 0 and seq.first_scheduled_time is None:
                seq.num_cached_tokens = num_computed
                seq.first_scheduled_time = now
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.num_scheduled_tokens[seq.seq_id] = num_new
            budget -= num_new
        return budget

    def _preemption_mode(self, seq: Sequence) -> str:
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = "swap" if seq.group_id is not None else "recompute"
        if mode == "swap" and not self.kv.can_swap:
            mode = "recompute"
        return mode

    def _preempt_youngest(self, scheduled: dict[str, int], current: Sequence | None) -> list[Sequence]:
        """Preempts the youngest running sequence; returns the preempted sequences.

        When swapping, the victim's group goes with it: its sequences not scheduled this step,
        except ``current`` (the one asking for room) unless it is the victim itself. The youngest
        is never one scheduled this step: those all precede ``current``.
        """
        victim = self.running[-1]
        if self._preemption_mode(victim) == "swap":
            unit = [victim]
            if victim.group_id is not None:
                unit = [
                    r
                    for r in self.running
                    if r.group_id == victim.group_id and r.seq_id not in scheduled and (r is victim or r is not current)
                ]
            if self.kv.swap_out(unit):
                for r in unit:
                    self.running.remove(r)
                    r.status = SequenceStatus.SWAPPED
                    r.num_preemptions += 1
                    self.runner_sync.preempted(r.seq_id)
                self.swapped.append(unit)
                self.num_preemptions += len(unit)
                self.num_swap_preemptions += len(unit)
                return list(unit)
            # The host pool is full: recompute instead.
        self.running.pop()
        self._preempt(victim)
        return [victim]

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.runner_sync.preempted(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- after the model ran -------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: ModelRunnerOutput) -> list[SampledToken]:
        """Advances computed counts, registers written blocks in the prefix cache, collects prompt
        logprobs, appends sampled tokens, checks token stops and frees finished sequences; returns
        the samples, in order. A speculating sequence gets several samples: it appends them in
        order until one stops it, its computed count advances over the tokens kept, and the
        slots of the drafts not kept go back."""
        for seq_id, n in out.num_scheduled_tokens.items():
            seq = self.seqs.get(seq_id)
            if seq is None or out.num_drafts(seq_id) is not None:
                continue
            seq.num_computed_tokens += n
            self.kv.cache_computed_blocks(seq)  # before the release: released full blocks stay cached
            self.kv.release_out_of_window(seq)
        for seq_id, chunk in sampled.prompt_logprobs.items():
            seq = self.seqs.get(seq_id)
            if seq is not None:
                seq.add_prompt_logprobs(chunk.first, chunk.entries)
        results = []
        rows = sampled.seq_ids
        i = 0
        while i < len(rows):
            seq = self.seqs[rows[i]]
            end = i + 1
            while end < len(rows) and rows[end] == rows[i]:
                end += 1
            num_drafts = out.num_drafts(seq.seq_id)
            kept = 0
            for row in range(i, end):
                tok = sampled.token_ids[row]
                seq.sampled_at_len = seq.num_tokens
                status = None
                if seq.auto_append:
                    seq.append_output_token(tok)
                    status = check_stop(seq, self.max_model_len)
                kept += 1
                index = seq.num_output_tokens - 1 if seq.auto_append else None
                lp, top = sampled.logprobs[row], sampled.top_logprobs[row]
                results.append(SampledToken(seq, tok, lp, top, seq.auto_append, status, index))
                if status is not None:
                    break  # a stop inside an accepted run: the tokens after it are not kept
            if num_drafts is not None:  # the slots past the tokens kept go back, the runner's too
                self.runner_sync.truncated(seq.seq_id, self.spec.verified(seq, self.kv, num_drafts, end - i - 1, kept))
            i = end
        for r in results:
            if r.finished is not None:
                self.finish_seq(r.seq.seq_id, r.finished)
        return results

    def on_step_failed(self, out: SchedulerOutput) -> None:
        """The runner raised on ``out``: what it holds of the scheduled sequences is unknown, so
        they are sent whole next time (computed counts did not advance), and the lookahead slots of
        its drafts go back."""
        self.runner_sync.step_failed(out)
        for seq_id in out.speculating_seq_ids:
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.status == SequenceStatus.RUNNING:
                self.kv.trim_to_computed(seq)
