"""Tool-call parsers (``--tool-call-parser NAME``): a model's raw text -> content + tool calls, in
the format its chat template teaches it (vLLM's parser names), one format per module."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    JSON_ERRORS,
    ToolCall,
    ToolParser,
    arguments_json,
    call_of,
    held_back,
    loads,
)
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_xml import Qwen3CoderToolParser, Qwen3XmlToolParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        PythonicToolParser,
        Qwen3XmlToolParser,
        Qwen3CoderToolParser,
    )
}


def tool_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"Unknown tool call parser {name!r}; available: {', '.join(sorted(PARSERS))}.")
    return PARSERS[name]()


__all__ = [
    "JSON_ERRORS",
    "PARSERS",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "Qwen3XmlToolParser",
    "ToolCall",
    "ToolParser",
    "arguments_json",
    "call_of",
    "held_back",
    "loads",
    "tool_parser",
]
