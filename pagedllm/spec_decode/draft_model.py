"""A draft model's proposals: the draft runs beside the target in the same runner, over its own
KV cache tensors addressed by the target's block ids and block tables.

Sharing the target's blocks means no second allocator: a block a sequence holds holds its K/V in
both caches, and copy-on-write, prefix caching and lookahead slots need no bookkeeping of their
own (block copies are replayed on the draft's cache too; swaps are not: see below).

Each sequence keeps how many of its tokens the draft has computed. In a step where it speculates,
the draft first runs the tokens it has not seen (the whole prompt the first time, in chunks of
max_num_batched_tokens as its prefill was; the last one or two accepted tokens afterwards), then
k - 1 single-token steps, each time taking its argmax: the drafts are a deterministic proposal
(q = a point mass), so greedy verification and the rejection sampler (rejection.py) keep the
target's output exactly. The work is batched over every speculating sequence of the step: one
draft forward per draft position. The draft's tokens do not count in the step's token budget
(max_num_batched_tokens is the target's).

The draft's K/V only ever affects which drafts are accepted, never the output (the target verifies
every one), so whenever it may be stale the count just starts over and the draft catches up:
a sequence the runner is sent whole (first scheduled, back from recompute or swap preemption, a
prefix-cache hit, a failed step) starts from 0, and a count is never trusted past the target's
own computed count (positions beyond it may hold rejected drafts).
"""

from __future__ import annotations

import torch

from pagedllm.kv.base import BlockOp
from pagedllm.runner.kv_cache import move_blocks
from pagedllm.runner.seq_state import SeqState
from pagedllm.scheduler_output import SchedulerOutput


class _DraftView:
    """A sequence as the draft runner sees it in one step: the target's tokens plus the drafts so
    far, computed up to the draft's own count."""

    def __init__(self, state: SeqState, num_computed: int) -> None:
        self.seq_id = state.seq_id
        self.num_prompt_tokens = state.num_prompt_tokens
        self.all_token_ids = list(state.all_token_ids)
        self.num_computed_tokens = num_computed
        self.wants_prompt_logprobs = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftProposer:
    def __init__(self, runner, max_chunk: int) -> None:
        """``runner``: a ModelRunner over the draft model and its caches, sharing the target
        runner's BlockTables. ``max_chunk``: the most tokens of one sequence a draft forward runs
        (the engine's max_num_batched_tokens: a long prompt's catch-up is chunked as its prefill was)."""
        self.runner = runner
        self.max_chunk = max_chunk
        self.num_computed: dict[str, int] = {}  # seq id -> tokens whose draft K/V is valid

    def forget(self, seq_id: str) -> None:
        """``seq_id``'s draft K/V is no longer known valid (its blocks moved, or it is gone)."""
        self.num_computed.pop(seq_id, None)

    def apply_copies(self, ops: list[BlockOp]) -> None:
        """Copy-on-write copies on the draft's cache too, so a sequence keeps its draft K/V when
        its block is the one copied. Swapped blocks are not moved (the host pool holds the
        target's only): a sequence swapped back in is sent whole, and starts over."""
        for op in ops:
            if op.kind == "copy":
                move_blocks(self.runner.kv_caches, self.runner.kv_caches, op.pairs)

    @torch.inference_mode()
    def propose(self, states: dict[str, SeqState], num_drafts: dict[str, int]) -> dict[str, list[int]]:
        """Each sequence's drafts (``num_drafts[seq id]`` of them), after its known tokens."""
        views: dict[str, _DraftView] = {}
        for sid in num_drafts:
            state = states[sid]
            # Below the target's computed count every token is final, so draft K/V written there
            # for the same tokens is valid; past it the draft may have run rejected drafts.
            valid = min(self.num_computed.get(sid, 0), state.num_computed_tokens)
            views[sid] = _DraftView(state, valid)
        drafts: dict[str, list[int]] = {sid: [] for sid in num_drafts}
        self.runner.states = views
        try:
            self._catch_up(views)
            for step in range(max(num_drafts.values(), default=0)):
                active = [sid for sid, k in num_drafts.items() if k > step]
                sched = SchedulerOutput(
                    num_scheduled_tokens={sid: views[sid].num_tokens - views[sid].num_computed_tokens for sid in active}
                )
                for sid, token in self.runner.greedy_tokens(sched).items():
                    view = views[sid]
                    view.num_computed_tokens = view.num_tokens
                    view.all_token_ids.append(token)
                    drafts[sid].append(token)
        finally:
            self.runner.states = {}
        for sid, view in views.items():
            self.num_computed[sid] = view.num_computed_tokens
        return drafts

    def _catch_up(self, views: dict[str, _DraftView]) -> None:
        """Runs chunks of ``max_chunk`` tokens until every sequence has at most that many left
        (none of these chunks reaches its last token, so none drafts)."""
        while True:
            behind = {sid: v.num_tokens - v.num_computed_tokens for sid, v in views.items()}
            chunks = {sid: self.max_chunk for sid, n in behind.items() if n > self.max_chunk}
            if not chunks:
                return
            self.runner.greedy_tokens(SchedulerOutput(num_scheduled_tokens=chunks))
            for sid, n in chunks.items():
                views[sid].num_computed_tokens += n
