"""LLMEngine: the synchronous step loop that ties scheduler, runner and detokenizer together."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from pagedllm.beam_search import BeamSearchParams, BeamSearchState
from pagedllm.config import EngineConfig
from pagedllm.host_memory import keep_freed_memory_in_heap
from pagedllm.kv.factory import make_kv_manager
from pagedllm.models.llama import sliding_window
from pagedllm.models.loader import load_hf_config, load_model, resolve_dtype
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.request import Request, RequestStatus, child_seed
from pagedllm.runner.kv_cache import allocate_kv_cache, kv_bytes_per_block, num_blocks_for_memory
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import Scheduler
from pagedllm.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger("pagedllm")

PromptType = str | list[int] | dict


def _token_ids(ids: object) -> list[int]:
    """Validates a token-id prompt: a list of ints (numpy ints accepted, bools and floats not)."""
    import numbers

    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}.")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if bad:
        raise ValueError(f"prompt_token_ids must be integers (token ids), got {bad[:3]!r}.")
    return [int(t) for t in ids]


@dataclass
class _BeamGroup:
    search: BeamSearchState
    beams: list[Request]  # live beams, best first
    candidates: dict[str, dict[int, float]] = field(default_factory=dict)  # beam id -> its top logprobs
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))


@dataclass
class _RequestState:
    """One user request: a sequence, or a group of them (n > 1 / best_of, beam search)."""

    request: Request  # sequence 0
    detokenizer: IncrementalDetokenizer | None  # sequence 0's
    # Every sequence of an n > 1 / best_of request by index (sequence 0 first), each with its
    # own detokenizer; just ``request`` otherwise.
    seqs: list[Request] = field(default_factory=list)
    detokenizers: dict[str, IncrementalDetokenizer | None] = field(default_factory=dict)
    beam: _BeamGroup | None = None

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs = [self.request]
            self.detokenizers = {self.request.request_id: self.detokenizer}

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.search.done
        return all(r.is_finished for r in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.models.resolve import resolve_model_path

        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.model_path = resolve_model_path(config.model)
        self.hf_config = load_hf_config(self.model_path)
        self.max_model_len = self._resolve_max_model_len()
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        t0 = time.perf_counter()
        cpu_kernels = None
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        if config.attention_backend == "auto" and self.device.type == "cpu":
            from pagedllm.kernels import load_cpu_kernels

            cpu_kernels = load_cpu_kernels()
        self.model = load_model(
            self.model_path, self.hf_config, self.dtype, self.device, self.max_model_len, cpu_kernels=cpu_kernels
        )
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        self.eos_token_ids = self._eos_token_ids()

        num_layers = len(self.model.layers)
        per_block = kv_bytes_per_block(
            num_layers, config.block_size, self.model.num_kv_heads, self.model.head_dim, self.dtype
        )
        self.num_kv_blocks = config.num_kv_blocks or num_blocks_for_memory(config.kv_cache_memory_gib, per_block)
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gib={config.kv_cache_memory_gib} is less than one KV block ({per_block} bytes)."
            )
        kv_caches = allocate_kv_cache(
            num_layers,
            self.num_kv_blocks,
            config.block_size,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.dtype,
            self.device,
        )
        self.kv_manager = make_kv_manager(config, self.num_kv_blocks, self.max_model_len)
        self.scheduler = Scheduler(config, self.kv_manager, self.max_model_len)
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            self.kv_manager,
            config.block_size,
            self.device,
            config.seed,
            cpu_kernels,
        )
        self._setup_swap(per_block)
        self._states: dict[str, _RequestState] = {}
        # Every live sequence's id -> its request's state (a group's sequences share one).
        self._seq_state: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        self.stats_counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        logger.info(
            "pagedllm: %s (%s) on %s, %s; KV cache %d blocks x %d tokens = %d tokens (%.2f GiB), "
            "max_model_len %d; ready in %.1fs",
            self.model_path,
            type(self.model).__name__,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.num_kv_blocks,
            config.block_size,
            self.num_kv_blocks * config.block_size,
            self.num_kv_blocks * per_block / 2**30,
            self.max_model_len,
            time.perf_counter() - t0,
        )

    # ---- set-up helpers ------------------------------------------------------------------
    def _setup_swap(self, bytes_per_block: int) -> None:
        """A host-memory KV pool (+ its tensors) when the preemption mode may swap."""
        cfg = self.config
        if cfg.preemption_mode == "recompute":
            return
        num_host = cfg.num_swap_blocks
        if num_host is None:
            num_host = num_blocks_for_memory(cfg.swap_space_gib, bytes_per_block)
        if num_host < 1:
            if cfg.preemption_mode == "swap":
                raise ValueError(
                    f"preemption_mode='swap' needs host memory: swap_space_gib="
                    f"{cfg.swap_space_gib} is less than one KV block ({bytes_per_block} bytes)."
                )
            return
        try:
            self.kv_manager.enable_swap(num_host)
        except NotImplementedError as e:
            if cfg.preemption_mode == "swap":
                raise ValueError(f"preemption_mode='swap' needs kv_layout='paged' ({e}).") from e
            return  # "auto": this layout only recomputes
        # Pinned host memory would make device->host copies asynchronous on CUDA; CPU: plain.
        self.runner.host_kv_caches = allocate_kv_cache(
            len(self.model.layers),
            num_host,
            cfg.block_size,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.dtype,
            torch.device("cpu"),
        )
        self.num_swap_blocks = num_host

    def _resolve_max_model_len(self) -> int:
        model_len = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        window = sliding_window(self.hf_config)
        if window is not None and window < model_len:
            logger.warning("sliding window %d < context %d: max_model_len capped at the window", window, model_len)
            model_len = window
        want = self.config.max_model_len
        if want is None:
            return model_len
        if want > model_len:
            raise ValueError(f"max_model_len={want} exceeds the model's context length ({model_len}).")
        return want

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (
            getattr(self.hf_config, "eos_token_id", None),
            getattr(self.tokenizer, "eos_token_id", None),
        ):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(self.model_path)
            e = gen.eos_token_id
            ids.update([e] if isinstance(e, int) else (e or []))
        except Exception:  # no generation_config.json: the config's and tokenizer's EOS suffice
            pass
        return ids

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    # ---- requests ------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, _token_ids(prompt)
        raise ValueError(f"A prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError if the prompt can never run; resolves max_tokens=None."""
        if not ids:
            raise ValueError("The prompt is empty: give at least one token.")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}.")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt is {len(ids)} tokens long, but this model's maximum context length is "
                f"{self.max_model_len} tokens (prompt + at least one generated token must fit)."
            )
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} for the "
                f"completion). Reduce the prompt or max_tokens."
            )
        if not self.kv_manager.can_ever_fit(len(ids) + params.max_tokens):
            raise ValueError(
                f"The request needs up to {len(ids) + params.max_tokens} tokens of KV cache, more than the whole "
                f"cache holds ({self.num_kv_blocks * self.config.block_size} tokens). Raise kv_cache_memory_gib."
            )

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validates and queues a request; raises ValueError (nothing queued) if it can never run."""
        params = (params or SamplingParams()).clone()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._states or request_id in self._seq_state:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        text, ids = self._tokenize(prompt)
        self._validate_prompt(ids, params)
        params.all_stop_token_ids = set(self.eos_token_ids)
        # n > 1 / best_of: sequence 0 is prefilled alone; its first sample draws a token for every
        # sequence, and the others fork off it then, sharing its prompt blocks (see step()).
        num_seqs = max(params.n, params.best_of or 1)
        if num_seqs > self.config.max_num_seqs:
            # A group runs together; more sequences than a step holds could never all run.
            field = "best_of" if (params.best_of or 1) > params.n else "n"
            raise ValueError(f"{field} must be <= max_num_seqs ({self.config.max_num_seqs}), got {num_seqs}.")
        group_id = request_id if num_seqs > 1 else None
        seqs = []
        for i in range(num_seqs):
            seq_id = request_id if i == 0 else f"{request_id}#{i}"
            if seq_id in self._seq_state:
                raise ValueError(f"request_id {request_id!r} clashes with a sequence id in use ({seq_id!r}).")
            seed = None if params.seed is None else child_seed(params.seed, i)
            seqs.append(
                Request(
                    seq_id,
                    ids,
                    params,
                    prompt=text,
                    arrival_time=arrival_time,
                    seed=seed,
                    group_id=group_id,
                    index=i,
                )
            )
        req = seqs[0]
        for child in seqs[1:]:
            child.fork_parent = req
        req.fork_children = seqs[1:]
        req.num_pending_seqs = num_seqs - 1
        detoks: dict[str, IncrementalDetokenizer | None] = {}
        for seq in seqs:
            detoks[seq.request_id] = None
            if params.detokenize:
                detoks[seq.request_id] = IncrementalDetokenizer(
                    self.tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
                )
        state = _RequestState(req, detoks[req.request_id], seqs, detoks)
        self._states[request_id] = state
        for seq in seqs:
            self._seq_state[seq.request_id] = state
        self.scheduler.add_request(req)
        return request_id

    def add_beam_search_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: BeamSearchParams,
        arrival_time: float | None = None,
    ) -> str:
        """Queues one prompt's beam search; its single output comes when the search ends.

        The prompt is prefilled once; its candidates start ``beam_width`` beams that fork off it,
        sharing its blocks. Every step each live beam runs one token and reports its top
        candidates; when all have, the group picks the next beams (beam_search.py): a parent
        picked once continues itself, picked again it forks (shared blocks, copy-on-write), not
        picked it is dropped (blocks freed).
        """
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._states or request_id in self._seq_state:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        text, ids = self._tokenize(prompt)
        search = BeamSearchState(params, self.eos_token_ids)
        # Each beam runs as a greedy sequence that reports its top candidates as logprobs; the
        # group decides its next token and when it ends, so its own stop checks are off.
        sp = SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=params.max_tokens,
            ignore_eos=True,
            logprobs=search.num_candidates,
            detokenize=False,
        )
        self._validate_prompt(ids, sp)
        req = Request(request_id, ids, sp, prompt=text, arrival_time=arrival_time, group_id=request_id)
        req.num_pending_seqs = params.beam_width - 1
        if params.temperature > 0:
            req.logprob_temperature = params.temperature
        state = _RequestState(req, None, beam=_BeamGroup(search, [req]))
        self._states[request_id] = state
        self._seq_state[request_id] = state
        self.scheduler.add_request(req)
        return request_id

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix block no sequence holds (vLLM's name); a no-op without caching."""
        pool = getattr(self.kv_manager, "pool", None)
        if pool is not None:
            pool.reset_prefix_cache()

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self._states.pop(rid, None)
            if state is None:
                continue
            live = state.beam.beams if state.beam is not None else state.seqs
            for seq in live:
                self.scheduler.finish_request(seq.request_id, RequestStatus.FINISHED_ABORTED)
                self._seq_state.pop(seq.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns an output for every request that advanced."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if sched.block_ops:  # everything was preempted: the swaps still have to happen
                self.runner.apply_block_ops(sched)
            return []
        sampled_reqs, samples = self.runner.execute(sched)
        now = time.monotonic()
        self.stats_counters["steps"] += 1
        if samples is None:
            self.scheduler.update_after_step(sched, {})
            return []
        # The sampler adds rows for sequences forking off a request at its first token (n > 1).
        rows = samples.requests if samples.requests is not None else sampled_reqs
        # Tokens that go straight to their sequence: not beams (their group picks), not forks.
        direct = {
            r.request_id: t
            for r, t in zip(rows, samples.token_ids, strict=True)
            if r.fork_parent is None and self._seq_state[r.request_id].beam is None
        }
        self.scheduler.update_after_step(sched, direct)
        # Forks first, before any sibling can finish and free the blocks they share.
        for i, req in enumerate(rows):
            parent = req.fork_parent
            if parent is not None:
                req.fork_parent = None
                parent.fork_children = []
                parent.num_pending_seqs = 0
                self.scheduler.fork(parent, req)
                req.first_scheduled_time = parent.first_scheduled_time
                req.first_token_time = now  # the prompt counts once, for sequence 0
                req.num_cached_tokens = parent.num_cached_tokens
                req.append_output_token(samples.token_ids[i])
        advanced: dict[str, _RequestState] = {}
        for i, req in enumerate(rows):
            state = self._seq_state[req.request_id]
            self.stats_counters["generation_tokens"] += 1
            if req.first_token_time is None:
                req.first_token_time = now
                self.stats_counters["prompt_tokens"] += req.num_prompt_tokens
            req.last_token_time = now
            if state.beam is not None:
                state.beam.candidates[req.request_id] = samples.top_logprobs[i]
                req.blocked = True  # until every beam of the group has its candidates
                advanced[req.group_id] = state
                continue
            self._append_token(state, req, samples.chosen_logprobs[i], samples.top_logprobs[i])
            advanced[state.request.request_id] = state
        outputs = []
        for rid, state in advanced.items():
            if state.beam is not None:
                if len(state.beam.candidates) < len(state.beam.beams):
                    continue
                self._advance_beams(state)
                if not state.finished:
                    continue  # a beam search reports once, at the end
            if state.finished:
                self._states.pop(rid, None)
            outputs.append(self._make_output(state))
        return outputs

    def _append_token(
        self, state: _RequestState, req: Request, logprob: float | None, top_logprobs: dict[int, float] | None
    ) -> None:
        """Bookkeeping of a sequence's new token: logprobs, stop checks, detokenization."""
        if logprob is not None:
            req.cumulative_logprob += logprob
        if req.logprobs is not None:
            req.logprobs.append(top_logprobs)
        detokenizer = state.detokenizers.get(req.request_id)
        status = self.scheduler.check_stop(req)
        sp = req.sampling_params
        # A token that ends generation (EOS, stop_token_ids) adds no text, as in vLLM, unless
        # the stop is asked to be in the output.
        stopped_by_token = status == RequestStatus.FINISHED_STOPPED
        if detokenizer is not None and (not stopped_by_token or sp.include_stop_str_in_output):
            # stop strings, like stop tokens, only count once min_tokens are out
            stop_str = detokenizer.add_token(
                req.output_token_ids[-1], check_stop=req.num_output_tokens >= sp.min_tokens
            )
            if stop_str is not None:
                req.stop_reason = stop_str
                status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self.scheduler.finish_request(req.request_id, status)
            self._seq_state.pop(req.request_id, None)

    def _advance_beams(self, state: _RequestState) -> None:
        """Every live beam has its candidates: pick the next beams, fork / drop, or finish."""
        group = state.beam
        assert group is not None
        beams = group.beams
        tops = [group.candidates[b.request_id] for b in beams]
        group.candidates.clear()
        nxt = group.search.step(
            [(b.cumulative_logprob, t) for b, t in zip(beams, tops, strict=True)],
            [(b.output_token_ids, b.logprobs or []) for b in beams],
        )
        if group.search.done:
            nxt = []
        # A parent picked once continues as itself; picked again, it forks first (the child
        # shares its blocks, before the parent's new token is appended); never picked, dropped.
        picked: set[int] = set()
        new_beams: list[tuple[Request, int]] = []
        for j, cand in enumerate(nxt):
            parent = beams[cand.beam]
            if cand.beam not in picked:
                picked.add(cand.beam)
                new_beams.append((parent, j))
                continue
            child = parent.fork(f"{state.request.request_id}#beam{next(group.ids)}", index=0)
            self._seq_state[child.request_id] = state
            self.scheduler.fork(parent, child)
            new_beams.append((child, j))
        for b, beam in enumerate(beams):
            if b not in picked:
                self.scheduler.finish_request(beam.request_id, RequestStatus.FINISHED_ABORTED)
                self._seq_state.pop(beam.request_id, None)
        for beam, j in new_beams:
            cand = nxt[j]
            beam.append_output_token(cand.token)
            beam.cumulative_logprob = cand.cum_logprob
            if beam.logprobs is not None:
                beam.logprobs.append(tops[cand.beam])
            beam.blocked = False
            beam.num_pending_seqs = 0
        group.beams = [beam for beam, _ in new_beams]

    def _completion(self, state: _RequestState, req: Request) -> CompletionOutput:
        finished = req.is_finished
        text = ""
        d = state.detokenizers.get(req.request_id)
        if d is not None:
            # While running, hold back a tail that may turn out to start a stop string, so the
            # cumulative text only ever grows (safe to stream as deltas).
            text = d.text[: d.stream_safe_len(finished)]
        return CompletionOutput(
            index=req.index,
            text=text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.needs_logprobs else None,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason if finished else None,
        )

    def _beam_completions(self, state: _RequestState) -> list[CompletionOutput]:
        """A finished beam search's hypotheses, best first (text without an ending EOS, as vLLM)."""
        assert state.beam is not None
        out = []
        for i, (hyp, toks, lps) in enumerate(state.beam.search.finished):
            shown = toks[:-1] if hyp.finish_reason == "stop" else toks
            out.append(
                CompletionOutput(
                    index=i,
                    text=self.tokenizer.decode(shown),
                    token_ids=list(toks),
                    cumulative_logprob=hyp.cum_logprob,
                    logprobs=list(lps),
                    finish_reason=hyp.finish_reason,
                )
            )
        return out

    def _make_output(self, state: _RequestState) -> RequestOutput:
        req = state.request
        finished = state.finished
        if state.beam is not None:
            completions = self._beam_completions(state)
        else:
            sp = req.sampling_params
            completions = [self._completion(state, seq) for seq in state.seqs]
            if len(completions) > sp.n:
                # best_of: the n sequences with the highest cumulative logprob (vLLM's rule).
                completions = sorted(completions, key=lambda c: -(c.cumulative_logprob or 0.0))[: sp.n]
        metrics = {"arrival_time": req.arrival_time}
        for k in ("first_scheduled_time", "first_token_time", "last_token_time", "finished_time"):
            v = getattr(req, k)
            if v is not None:
                metrics[k] = v
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=req.num_cached_tokens,
        )

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
            **self.stats_counters,
        }
