"""LLMEngine: requests in, RequestOutputs out, one step at a time.

Construction is engine/builder.py's (model, kernels, KV sizing, swap); the step loop over
sequences is EngineCore's (engine/core.py); a request's sequences are a group (engine/groups.py
for n >= 1 and best_of, engine/beam_group.py for beam search). This class validates requests,
routes each step's samples to their groups and returns what advanced.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection

from pagedllm.beam_search import BeamSearchParams, BeamSearchState
from pagedllm.config import EngineConfig
from pagedllm.engine.beam_group import BeamGroup
from pagedllm.engine.builder import build_engine
from pagedllm.engine.core import EngineCore
from pagedllm.engine.groups import SampleGroup
from pagedllm.engine.intake import PromptType, check_logprobs, tokenize_prompt, truncate_prompt, validate_prompt
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence
from pagedllm.structured_output.grammar import CompiledGrammar
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.token_controls import bad_words_token_ids, check_token_controls, prepare_token_controls
from pagedllm.tokenizer import TokenTexts

__all__ = ["LLMEngine", "PromptType"]

Group = SampleGroup | BeamGroup


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine(config)
        self.config = config
        self.parts = parts
        self.model_path = parts.model_path
        self.hf_config = parts.hf_config
        self.max_model_len = parts.max_model_len
        self.dtype = parts.dtype
        self.kv_dtype = parts.kv_dtype
        self.kv_bytes_per_block = parts.kv_bytes_per_block  # this rank's
        self.device = parts.device
        self.model = parts.model
        # Optional model method: what besides its tokens decides a sequence's cached keys (a
        # prefix-cache salt, by prompt length), for families where the tokens alone do not.
        self._prefix_cache_salt = getattr(parts.model, "prefix_cache_salt", lambda num_prompt_tokens: None)
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.token_texts = TokenTexts(parts.tokenizer)
        # Defaults of request fields left unset (generation_config.py); {} with generation_config="vllm"
        self.default_sampling_params = parts.default_sampling
        self.num_kv_blocks = parts.num_kv_blocks
        self.num_swap_blocks = parts.num_swap_blocks
        self.kv_manager = parts.kv_manager
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, _grammar_eos(self))
        self.core = EngineCore(parts.scheduler, parts.runner, self.structured)
        self._groups: dict[str, Group] = {}  # request id -> its group
        self._group_of: dict[str, Group] = {}  # live sequence id -> its group
        self._ids = itertools.count()
        self.stats_counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    # ---- requests ------------------------------------------------------------------------
    def _new_request_id(self, request_id: str | None) -> str:
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._groups or request_id in self._group_of:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        return request_id

    def _prompt(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        text, ids = tokenize_prompt(self.tokenizer, prompt)
        # Sliced here, never by setting truncation on the tokenizer: it is shared across threads.
        ids = truncate_prompt(ids, params, self.max_model_len)
        validate_prompt(ids, params, self.vocab_size, self.max_model_len, self.kv_manager)
        return text, ids

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        compiled_grammar: CompiledGrammar | None = None,
    ) -> str:
        """Validates and queues a request; raises ValueError (nothing queued) if it can never run.

        ``compiled_grammar``: its structured output compiled already (AsyncLLMEngine compiles off
        this thread); else it is compiled here."""
        params = (params or SamplingParams()).clone()
        request_id = self._new_request_id(request_id)
        check_logprobs(params, self.vocab_size, self.config.max_logprobs)
        check_token_controls(params, self.vocab_size)
        if params.logit_bias or params.allowed_token_ids is not None:
            prepare_token_controls(params, self.vocab_size)
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        text, ids = self._prompt(prompt, params)
        params.all_stop_token_ids = set(self.eos_token_ids)
        if self.tokenizer is None:  # skip_tokenizer_init: token ids only
            if params.stop:
                raise ValueError("stop strings need the tokenizer (skip_tokenizer_init=True); use stop_token_ids.")
            params.detokenize = False
        num_seqs = max(params.n, params.best_of or 1)
        if num_seqs > self.config.max_num_seqs:
            # A group runs together; more sequences than a step holds could never all run.
            field = "best_of" if (params.best_of or 1) > params.n else "n"
            raise ValueError(f"{field} must be <= max_num_seqs ({self.config.max_num_seqs}), got {num_seqs}.")
        clashes = [f"{request_id}#{i}" for i in range(1, num_seqs) if f"{request_id}#{i}" in self._group_of]
        if clashes:
            raise ValueError(f"request_id {request_id!r} clashes with a sequence id in use ({clashes[0]!r}).")
        salt = self._prefix_cache_salt(len(ids))
        first = Sequence(request_id, ids, params, arrival_time=arrival_time, cache_salt=salt)
        if params.structured_outputs is not None:
            first.grammar = self.structured.new_state(params.structured_outputs, compiled_grammar)
        self._groups[request_id] = SampleGroup(
            request_id, text, first, self.core, self._group_of, self.tokenizer, self.token_texts
        )
        return request_id

    def add_beam_search_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: BeamSearchParams,
        arrival_time: float | None = None,
    ) -> str:
        """Queues one prompt's beam search; its single output comes when the search ends."""
        request_id = self._new_request_id(request_id)
        search = BeamSearchState(params, self.eos_token_ids)
        # Each beam runs as a greedy sequence that reports its top candidates as logprobs; the
        # group decides its next token and when it ends, so the core's stop checks never apply.
        sp = SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=params.max_tokens,
            ignore_eos=True,
            logprobs=search.num_candidates,
            detokenize=False,
        )
        if params.temperature > 0:
            sp.logprob_temperature = params.temperature
        text, ids = self._prompt(prompt, sp)
        salt = self._prefix_cache_salt(len(ids))
        first = Sequence(request_id, ids, sp, arrival_time=arrival_time, auto_append=False, cache_salt=salt)
        group = BeamGroup(request_id, text, first, search, self.core, self._group_of, self.tokenizer)
        self._groups[request_id] = group
        return request_id

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix block no sequence holds (vLLM's name); a no-op without caching."""
        pool = getattr(self.kv_manager, "pool", None)
        if pool is not None:
            pool.reset_prefix_cache()

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.pop(rid, None)
            if group is not None:
                group.abort()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ---- the step ------------------------------------------------------------------------
    def last_step_request_ids(self) -> list[str]:
        """The requests the latest step scheduled (also when it raised), in scheduling order."""
        ids = (self._group_of.get(sid) for sid in self.core.last_scheduled)
        return list(dict.fromkeys(g.request_id for g in ids if g is not None))

    def step(self, only_requests: Collection[str] | None = None) -> list[RequestOutput]:
        """Runs one scheduler step; returns an output for every request that advanced.

        ``only_requests``: run only (the running sequences of) these requests this step; see
        EngineCore.step. Used to retry a step that raised without the request that broke it.
        """
        steps_before = self.core.num_steps
        only = None
        if only_requests is not None:
            wanted = set(only_requests)
            only = [sid for sid, g in self._group_of.items() if g.request_id in wanted]
        samples = self.core.step(only)
        self.stats_counters["steps"] += self.core.num_steps - steps_before
        now = time.monotonic()
        advanced: dict[str, Group] = {}
        for s in samples:
            if s.discarded:
                continue  # after a stop string in the same speculated run
            seq = s.seq
            group = self._group_of[seq.seq_id]
            self.stats_counters["generation_tokens"] += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.stats_counters["prompt_tokens"] += seq.num_prompt_tokens
            seq.last_token_time = now
            group.on_sample(s, now)
            advanced[group.request_id] = group
        outputs = []
        for rid, group in advanced.items():
            if not group.has_output():
                continue
            if group.finished:
                self._groups.pop(rid, None)
            outputs.append(group.make_output())
        return outputs

    def shutdown(self, graceful: bool = True) -> None:
        """Stops the tensor-parallel workers (processes or Ray actors) and leaves their process
        group; later steps raise TensorParallelWorkerError. Idempotent. A single-rank engine
        holds nothing outside this process: nothing to stop, and it keeps working.
        ``graceful=False``: a step may still be running on another thread; the workers are
        killed rather than sent the stop message (which would interleave with that step's)."""
        self.structured.shutdown()
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop(graceful)

    # ---- stats ---------------------------------------------------------------------------
    def get_stats(self) -> dict:
        kv = self.kv_manager.stats()
        queries, hits = self.kv_manager.prefix_cache_stats()
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.kv_manager.usage(),
            "num_kv_blocks": self.num_kv_blocks,
            "num_free_kv_blocks": self.kv_manager.num_free_blocks(),
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "kv_cache_bytes": self.num_kv_blocks * self.kv_bytes_per_block,  # a draft model's included
            **(
                {"draft_kv_cache_bytes": self.num_kv_blocks * self.parts.draft_kv_bytes_per_block}
                if self.parts.draft_kv_bytes_per_block
                else {}
            ),
            "kv_slots_total": kv.total,
            "kv_slots_reserved": kv.reserved,
            "kv_slots_used": kv.used,
            "kv_waste": kv.waste,
            "kv_shared_blocks": kv.shared_blocks,
            "kv_logical_blocks": kv.logical_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swap_preemptions": self.scheduler.num_swap_preemptions,
            "num_requests_swapped": self.scheduler.num_swapped,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "iteration_tokens": dict(self.core.iteration_tokens),
            **(self.scheduler.spec.stats() if self.scheduler.spec is not None else {}),
            **self.stats_counters,
        }

    def get_kv_blocks(self) -> dict:
        """The KV cache block by block (kv/block_view.py) with get_stats() of the same moment, so a
        viewer's counters and its grid agree. JSON-ready; shares no mutable state with the engine."""
        snapshot = self.kv_manager.block_snapshot().to_dict()
        for seq in snapshot["seqs"]:
            group = self._group_of.get(seq["seq_id"])
            seq["request_id"] = group.request_id if group is not None else seq["seq_id"]
        return {**snapshot, "stats": self.get_stats()}


def _grammar_eos(engine: LLMEngine) -> int | None:
    """The end-of-sequence token a completed structured output allows: the tokenizer's own when
    the engine stops on it, else the lowest stop id."""
    eos = getattr(engine.tokenizer, "eos_token_id", None)
    if eos in engine.eos_token_ids or not engine.eos_token_ids:
        return eos
    return min(engine.eos_token_ids)
