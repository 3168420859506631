"""The offline API, as in vLLM: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

ChatMessage = dict[str, str]


class LLM:
    """Loads a model once; ``generate`` runs a whole list of prompts with continuous batching.

    ``kwargs`` are EngineConfig's fields and vLLM's engine arguments (``gpu_memory_utilization``,
    ``swap_space``, ``tensor_parallel_size=1``, ``enforce_eager``, ...; see pagedllm/vllm_args.py).
    A vLLM argument pagedllm cannot honour raises ValueError naming it; an unknown name, TypeError.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs: object) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers this LLM started (LLMEngine.shutdown); they also stop
        when the LLM is garbage-collected or the process exits."""
        self.llm_engine.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without SamplingParams: the model's generation_config defaults
        (per the generation_config engine argument), else SamplingParams()."""
        return SamplingParams(**self.llm_engine.default_sampling_params)  # type: ignore[arg-type]

    def reset_prefix_cache(self) -> None:
        """Drops the cached prompt prefixes (benchmarks repeat a workload from a cold cache)."""
        self.llm_engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in input order.

        All requests are validated before any runs: one bad prompt raises ValueError and
        nothing is queued.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"Got {len(params)} SamplingParams for {len(prompts)} prompts.")
        engine = self.llm_engine
        ids = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                ids.append(engine.add_request(None, p, sp))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's offline API); one output per prompt, in order.

        Selection follows Hugging Face ``generate(num_beams=beam_width, do_sample=False,
        length_penalty=..., early_stopping=...)``; beams share KV blocks (forks + copy-on-write).
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for p in prompts:
                ids.append(engine.add_beam_search_request(None, p, params))
        except Exception:
            engine.abort_request(ids)
            raise
        results = []
        for out in self._run(ids, use_tqdm):
            seqs = []
            for c in out.outputs:
                n = len(c.token_ids)
                seqs.append(
                    BeamSearchSequence(
                        tokens=list(out.prompt_token_ids) + list(c.token_ids),
                        logprobs=c.logprobs or [],
                        cum_logprob=c.cumulative_logprob or 0.0,
                        text=c.text,
                        finish_reason=c.finish_reason,
                        score=(c.cumulative_logprob or 0.0) / n**params.length_penalty,
                    )
                )
            results.append(BeamSearchOutput(seqs))
        return results

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        engine = self.llm_engine
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))  # leave the engine clean (no held blocks)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self.apply_chat_template(c, add_generation_prompt, chat_template) for c in conversations]
        # No special tokens added: the template writes them (a BOS twice would change the output),
        # as the server renders chats (serving_chat) and vLLM's LLM.chat does.
        tok = self.get_tokenizer()
        prompts = [{"prompt": t, "prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> str:
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat() needs the tokenizer, which skip_tokenizer_init=True skips.")
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("This model's tokenizer has no chat template; pass chat_template=... or use generate().")
        return tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
        )
