"""EngineClient: what the OpenAI server needs from an engine, whether in this process or not.

Two implementations: AsyncLLMEngine (one engine thread in the server's process, data parallel
size 1) and DataParallelClient (engine replicas in Ray actors, data_parallel/client.py). The
serving layer talks to this protocol only, so it never reaches into an LLMEngine that may live in
another process.

ModelFacts are the model's and KV cache's numbers the server checks requests against and shows
(max_model_len, vocabulary size, generation defaults, KV capacity...): plain data, so a replica
can send them to a front end that has no weights.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.intake import PromptType
    from pagedllm.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class ModelFacts:
    model_path: str
    tokenizer_path: str
    max_model_len: int
    vocab_size: int
    # Defaults of request fields left unset (the model's generation config)
    default_sampling_params: dict[str, Any]
    num_kv_blocks: int
    block_size: int
    enable_prefix_caching: bool
    chat_template: str | None  # the engine tokenizer's (the engine argument chat_template replaces the model's)
    device_type: str
    cache_config: dict[str, str]  # the labels of the cache_config_info metric

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @classmethod
    def of(cls, llm: LLMEngine) -> ModelFacts:
        from pagedllm.engine.builder import tokenizer_path

        config = llm.config
        return cls(
            model_path=llm.model_path,
            tokenizer_path=tokenizer_path(config, llm.model_path),
            max_model_len=llm.max_model_len,
            vocab_size=llm.vocab_size,
            default_sampling_params=dict(llm.default_sampling_params),
            num_kv_blocks=llm.num_kv_blocks,
            block_size=llm.kv_manager.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            chat_template=getattr(llm.tokenizer, "chat_template", None),
            device_type=llm.device.type,
            # vLLM's names for the KV cache's configuration
            cache_config={
                "block_size": str(config.block_size),
                "cache_dtype": config.kv_cache_dtype,
                "enable_prefix_caching": str(config.enable_prefix_caching),
                "gpu_memory_utilization": str(config.gpu_memory_utilization),
                "num_cpu_blocks": str(llm.num_swap_blocks),
                "num_gpu_blocks": str(llm.num_kv_blocks),
                "num_gpu_blocks_override": str(config.num_kv_blocks),
                "swap_space": str(config.swap_space_gib),
            },
        )


class OutputStream(Protocol):
    """One request's outputs (cumulative; the last has finished=True), as RequestStream gives them.

    Iteration raises RequestFailedError / EngineDeadError if the engine failed the request.
    """

    request_id: str
    finished: bool

    def abort(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...


class EngineClient(Protocol):
    facts: ModelFacts
    # The tokenizer the engine decodes with; None when the engine has none (skip_tokenizer_init).
    tokenizer: Any
    # Called for every output as it reaches the server: (output, the request's previous token time).
    output_hook: Callable[[RequestOutput, float | None], None] | None
    # Called when the engine is gone for good (the server exits so a supervisor restarts it).
    on_dead: Callable[[BaseException], None] | None
    max_step_failures: int

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> OutputStream:
        """Queues a request; its stream once accepted. ValueError / TypeError / NotImplementedError
        for a request the engine refuses, EngineDeadError when no engine runs."""
        ...

    def abort(self, request_ids: str | list[str]) -> None: ...

    async def health_problem(self) -> str | None:
        """None when the engine serves; else why not (/health answers 503 with it)."""
        ...

    async def get_stats(self) -> dict:
        """What /stats shows; with data parallelism a ``replicas`` list of each replica's."""
        ...

    async def get_stats_snapshot(self) -> dict:
        """get_stats() as the engine last published it (at most a second old while it steps):
        what /metrics shows, so that scrapes never query the engine thread."""
        ...

    async def get_kv_blocks(self, replica: int | None = None) -> dict:
        """The KV cache's blocks (of one replica: ``replica``, by default the first)."""
        ...
