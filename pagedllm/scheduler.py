"""Continuous batching: which requests run this step, and how many tokens each.

Every step, running requests go first (their next decode token, or their next prefill chunk),
then waiting requests are admitted in arrival order while the token budget
(max_num_batched_tokens), the sequence limit (max_num_seqs) and free KV blocks allow. A long
prompt is split into chunks across steps (chunked prefill). When a running request cannot get
a block, the youngest running request is preempted: its blocks are freed and it goes back to
the front of the queue to be recomputed later, losing nothing but time.

The scheduler never touches tensors; it only decides.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import EngineConfig
from pagedllm.kv.base import KVCacheManager
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

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

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
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        req.finished_time = time.monotonic()
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- the decision --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        # 1. Running requests, oldest first: each gets its remaining tokens (1 when decoding).
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()  # youngest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                i += 1

        # 2. Waiting requests in arrival order (no admissions in a step that had to preempt:
        #    memory is short, admitting more would only preempt again).
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req)
            num_computed = len(cached) * self.kv.block_size
            num_new = min(req.num_tokens - num_computed, budget)
            if not self.kv.allocate_slots(req, num_new, cached):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if req.num_preemptions == 0 and req.first_scheduled_time is None:
                req.num_cached_tokens = num_computed
                req.first_scheduled_time = now
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return out

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
