"""Continuous batching: which requests run this step, and how many tokens each.

Every step, running requests go first (their next decode token, or their next prefill chunk),
then swapped-out requests come back, then waiting requests are admitted in arrival order while
the token budget (max_num_batched_tokens), the sequence limit (max_num_seqs) and free KV blocks
allow. A long prompt is split into chunks across steps (chunked prefill).

Preemption. When a running request cannot get a block, the youngest running request is
preempted, by one of two mechanisms (``preemption_mode``):
- "recompute" (default): its blocks are freed and it goes back to the front of the queue, to be
  prefilled again (prompt + what it generated) later, losing nothing but time;
- "swap": its blocks are copied to the host-memory pool and freed on the device; it comes back
  (blocks copied back) before anything new is admitted. A forked group (n > 1, beam search) is
  swapped out together, so blocks its sequences share are copied once and stay shared. When the
  host pool is full, preemption falls back to recompute;
- "auto": swap for sequences of a group (n > 1, beams), whose shared blocks recompute would
  duplicate, and recompute for plain requests (on a CPU device a swap is a memory-to-memory copy
  and recomputing a prompt is about as fast, without the host pool's memory).
Under recompute each sequence of a forked group is preempted on its own, as the plain sequence
it is (prompt + its own outputs); with prefix caching on, its siblings' full blocks are found
again in the cache when it comes back.

Forks and blocked sequences. ``fork`` adds a sequence that shares its parent's blocks (through the
KV manager, copy-on-write). A beam search holds beams ``blocked`` until all beams of its group
scored their candidates: a blocked request has nothing to run and is not admitted. If every
running request is blocked while others cannot get in, the youngest is preempted to make room
(else a beam group could wait forever for a beam that does not fit).

The scheduler never touches tensors; it only decides. Block copies and swaps it causes are in
``SchedulerOutput.block_ops``, for the runner to execute before the forward.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import EngineConfig
from pagedllm.kv.base import BlockOp, KVCacheManager
from pagedllm.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens all_token_ids[num_computed : num_computed + num_new_tokens] run now

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a next token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    # Block copies (copy-on-write) and swaps to execute before the forward, in this order.
    block_ops: list[BlockOp] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def _pairs(self, kind: str) -> list[tuple[int, int]]:
        return [p for op in self.block_ops if op.kind == kind for p in op.pairs]

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        return self._pairs("copy")

    @property
    def blocks_to_swap_out(self) -> list[tuple[int, int]]:
        return self._pairs("swap_out")

    @property
    def blocks_to_swap_in(self) -> list[tuple[int, int]]:
        return self._pairs("swap_in")


class Scheduler:
    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Swapped-out units (a request, or the sequences of one group swapped together), oldest first.
        self.swapped: deque[list[Request]] = deque()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of num_preemptions, those by swapping

    # ---- queue management ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (stop, length, abort): its blocks are free for the very next step."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            unit = self._unit_of(req)
            unit.remove(req)
            if not unit:
                self.swapped.remove(unit)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        req.finished_time = time.monotonic()
        return req

    def fork(self, parent: Request, child: Request) -> None:
        """Adds ``child`` (a copy of ``parent``'s tokens) beside its parent, sharing its blocks.

        A parent on the device or swapped out shares its blocks (the child lands in the same
        place, right after it: groups stay together). A parent without blocks (preempted by
        recompute), or a manager that cannot share, gives a child that recomputes its tokens.
        """
        self.requests[child.request_id] = child
        if parent.status in (RequestStatus.RUNNING, RequestStatus.SWAPPED) and self.kv.fork(parent, child):
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = parent.status
            if parent.status == RequestStatus.RUNNING:
                self.running.insert(self.running.index(parent) + 1, child)
            else:
                unit = self._unit_of(parent)
                unit.insert(unit.index(parent) + 1, child)
            return
        child.num_computed_tokens = 0
        child.status = RequestStatus.WAITING
        if parent in self.waiting:
            self.waiting.insert(self.waiting.index(parent) + 1, child)
        else:
            self.waiting.appendleft(child)  # as old as its parent: ahead of later arrivals

    def _unit_of(self, req: Request) -> list[Request]:
        for unit in self.swapped:
            if any(r is req for r in unit):
                return unit
        raise KeyError(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

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
        scheduled: set[str] = set()

        # 1. Running requests, oldest first: each gets its remaining tokens (1 when decoding).
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1  # idle: blocked until its beam group picks its next token
                continue
            passed = None  # running[:i] as it was, once a preemption may change the indices
            preempted_self = False
            while not self.kv.allocate_slots(req, num_new):
                if passed is None:
                    passed = self.running[:i]
                victims = self._preempt_youngest(scheduled, req)
                out.preempted.extend(victims)
                if req in victims:
                    preempted_self = True
                    break
            if passed is not None:
                # A swapped group may have taken idle members from before req, too.
                i = sum(1 for r in passed if r.status == RequestStatus.RUNNING)
            if not preempted_self:
                out.scheduled.append(ScheduledRequest(req, num_new))
                scheduled.add(req.request_id)
                budget -= num_new
                i += 1

        # 2 and 3. Swapped-out requests come back, then waiting ones are admitted (not in a step
        #    that had to preempt: memory is short, admitting more would only preempt again).
        admit = not out.preempted
        while True:
            if admit:
                budget = self._swap_in(out, budget, scheduled)
                if not any(not all(r.blocked for r in u) for u in self.swapped):
                    budget = self._admit(out, budget, now, scheduled)
            # Nothing runs, yet requests wait, and every running request is idle (a beam waiting for
            # its group): preempt the youngest to let the others in. (A request swapped in but not
            # yet given its slots is not idle: it runs next step.)
            if (
                out.scheduled
                or not self.running
                or not self._has_runnable_outside()
                or any(r.num_computed_tokens < r.num_tokens for r in self.running)
            ):
                break
            out.preempted.extend(self._preempt_youngest(scheduled, None))
            admit = True
        out.block_ops = self.kv.take_block_ops()
        return out

    def _has_runnable_outside(self) -> bool:
        return any(not r.blocked for r in self.waiting) or any(not r.blocked for u in self.swapped for r in u)

    def _swap_in(self, out: SchedulerOutput, budget: int, scheduled: set[str]) -> int:
        for unit in list(self.swapped):
            if budget <= 0:
                break
            if all(r.blocked for r in unit):
                continue  # nothing to run until its group decides: stays in host memory
            if self.running and len(self.running) + len(unit) > self.config.max_num_seqs:
                break
            # Leave a block per sequence free, so they can take their next token at once; with
            # nothing else on the device, no margin (the unit fitted when it was swapped out).
            if not self.kv.swap_in(unit, reserve=len(unit) if self.running else 0):
                break
            self.swapped.remove(unit)
            for r in unit:
                r.status = RequestStatus.RUNNING
                self.running.append(r)
                out.swapped_in.append(r)
            for r in unit:
                num_new = min(r.num_tokens - r.num_computed_tokens, budget)
                if num_new > 0 and self.kv.allocate_slots(r, num_new):
                    out.scheduled.append(ScheduledRequest(r, num_new))
                    scheduled.add(r.request_id)
                    budget -= num_new
        return budget

    def _admit(self, out: SchedulerOutput, budget: int, now: float, scheduled: set[str]) -> int:
        idx = 0
        while idx < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[idx]
            if req.blocked:
                idx += 1  # its beam group has not picked its next token yet
                continue
            # A request about to fork (n > 1, beam search) needs room for its future sequences.
            if self.running and len(self.running) + 1 + req.num_pending_seqs > self.config.max_num_seqs:
                break
            cached = self.kv.find_cached_prefix(req)
            num_computed = len(cached) * self.kv.block_size
            num_new = min(req.num_tokens - num_computed, budget)
            if not self.kv.allocate_slots(req, num_new, cached):
                break  # FCFS: nobody overtakes the head of the queue
            del self.waiting[idx]
            if req.num_preemptions == 0 and req.first_scheduled_time is None:
                req.num_cached_tokens = num_computed
                req.first_scheduled_time = now
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            scheduled.add(req.request_id)
            budget -= num_new
        return budget

    def _preemption_mode(self, req: Request) -> str:
        mode = self.config.preemption_mode
        if mode == "auto":
            mode = "swap" if req.group_id is not None else "recompute"
        if mode == "swap" and not self.kv.can_swap:
            mode = "recompute"
        return mode

    def _preempt_youngest(self, scheduled: set[str], current: Request | None) -> list[Request]:
        """Preempts the youngest running request; returns the preempted requests.

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
                    if r.group_id == victim.group_id
                    and r.request_id not in scheduled
                    and (r is victim or r is not current)
                ]
            if self.kv.swap_out(unit):
                for r in unit:
                    self.running.remove(r)
                    r.status = RequestStatus.SWAPPED
                    r.num_preemptions += 1
                self.swapped.append(unit)
                self.num_preemptions += len(unit)
                self.num_swap_preemptions += len(unit)
                return list(unit)
            # The host pool is full: recompute instead.
        self.running.pop()
        self._preempt(victim)
        return [victim]

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the model ran -------------------------------------------------------------
    def update_after_step(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advances computed counts, appends sampled tokens; returns requests that got a token."""
        got_token = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            tok = sampled.get(req.request_id)
            if tok is not None:
                req.append_output_token(tok)
                got_token.append(req)
        return got_token

    def check_stop(self, req: Request) -> RequestStatus | None:
        """Token-level stop conditions (stop strings are the detokenizer's job)."""
        sp = req.sampling_params
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and last in sp.all_stop_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                req.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
