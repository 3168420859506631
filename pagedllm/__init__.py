"""pagedllm: high-throughput LLM inference and serving with PagedAttention."""

from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.entrypoints.llm import LLM
from pagedllm.logprobs import Logprob
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "__version__",
]
