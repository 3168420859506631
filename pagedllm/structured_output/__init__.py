"""Structured outputs: a grammar per sequence masks the logits of every step (vLLM's design)."""

from pagedllm.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "GuidedDecodingParams"]
