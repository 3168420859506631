"""LLMEngine: the synchronous step loop that ties scheduler, runner and detokenizer together."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.kv.factory import make_kv_manager
from pagedllm.models.llama import sliding_window
from pagedllm.models.loader import load_hf_config, load_model, resolve_dtype
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.runner.kv_cache import allocate_kv_cache, kv_bytes_per_block, num_blocks_for_memory
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import Scheduler
from pagedllm.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger("pagedllm")

PromptType = str | list[int] | dict


@dataclass
class _RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer | None


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
        self.model = load_model(self.model_path, self.hf_config, self.dtype, self.device, self.max_model_len)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        self.eos_token_ids = self._eos_token_ids()

        num_layers = len(self.model.layers)
        per_block = kv_bytes_per_block(num_layers, config.block_size, self.model.num_kv_heads,
                                       self.model.head_dim, self.dtype)
        self.num_kv_blocks = config.num_kv_blocks or num_blocks_for_memory(config.kv_cache_memory_gib, per_block)
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gib={config.kv_cache_memory_gib} is less than one KV block ({per_block} bytes)."
            )
        kv_caches = allocate_kv_cache(num_layers, self.num_kv_blocks, config.block_size, self.model.num_kv_heads,
                                      self.model.head_dim, self.dtype, self.device)
        self.kv_manager = make_kv_manager(config, self.num_kv_blocks, self.max_model_len)
        self.scheduler = Scheduler(config, self.kv_manager, self.max_model_len)
        self.runner = ModelRunner(self.model, kv_caches, self.kv_manager, config.block_size, self.device, config.seed,
                                  config.attention_backend)
        self._states: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        self.stats_counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        logger.info(
            "pagedllm: %s (%s) on %s, %s; KV cache %d blocks x %d tokens = %d tokens (%.2f GiB), "
            "max_model_len %d; ready in %.1fs",
            self.model_path, type(self.model).__name__, self.device, str(self.dtype).removeprefix("torch."),
            self.num_kv_blocks, config.block_size, self.num_kv_blocks * config.block_size,
            self.num_kv_blocks * per_block / 2**30, self.max_model_len, time.perf_counter() - t0,
        )

    # ---- set-up helpers ------------------------------------------------------------------
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
        for src in (getattr(self.hf_config, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
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
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"A prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")

    def add_request(
        self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validates and queues a request; raises ValueError (nothing queued) if it can never run."""
        params = (params or SamplingParams()).clone()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        if params.n > 1 or (params.best_of or 1) > 1:
            raise NotImplementedError("n > 1 / best_of > 1 (parallel sampling) is not supported yet.")
        text, ids = self._tokenize(prompt)
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
        params.all_stop_token_ids = set(self.eos_token_ids)
        req = Request(request_id, ids, params, prompt=text, arrival_time=arrival_time)
        detok = None
        if params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output)
        self._states[request_id] = _RequestState(req, detok)
        self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED) is not None:
                self._states.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns an output for every request that advanced."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        sampled_reqs, samples = self.runner.execute(sched)
        now = time.monotonic()
        sampled = {}
        if samples is not None:
            sampled = {r.request_id: t for r, t in zip(sampled_reqs, samples.token_ids, strict=True)}
        self.stats_counters["steps"] += 1
        self.scheduler.update_after_step(sched, sampled)
        outputs = []
        for i, req in enumerate(sampled_reqs):
            self.stats_counters["generation_tokens"] += 1
            if req.first_token_time is None:
                req.first_token_time = now
                self.stats_counters["prompt_tokens"] += req.num_prompt_tokens
            req.last_token_time = now
            req.cumulative_logprob += samples.chosen_logprobs[i]
            if req.logprobs is not None:
                req.logprobs.append(samples.top_logprobs[i])
            state = self._states[req.request_id]
            status = self.scheduler.check_stop(req)
            if state.detokenizer is not None:
                stop_str = state.detokenizer.add_token(req.output_token_ids[-1])
                if stop_str is not None:
                    req.stop_reason = stop_str
                    status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                self.scheduler.finish_request(req.request_id, status)
                self._states.pop(req.request_id)
            outputs.append(self._make_output(state))
        return outputs

    def _make_output(self, state: _RequestState) -> RequestOutput:
        req = state.request
        finished = req.is_finished
        text = ""
        if state.detokenizer is not None:
            # While running, hold back a tail that may turn out to start a stop string, so the
            # cumulative text only ever grows (safe to stream as deltas).
            d = state.detokenizer
            text = d.text[: d.stream_safe_len(finished)]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason if finished else None,
        )
        metrics = {"arrival_time": req.arrival_time}
        for k in ("first_scheduled_time", "first_token_time", "last_token_time", "finished_time"):
            v = getattr(req, k)
            if v is not None:
                metrics[k] = v
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[completion], finished=finished, metrics=metrics, num_cached_tokens=req.num_cached_tokens,
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
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            **self.stats_counters,
        }
