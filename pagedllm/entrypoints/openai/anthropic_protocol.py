"""Anthropic Messages request shapes (pydantic), and what the OpenAPI document says of the answers.

As for the OpenAI requests (protocol.py): types are strict, an unknown top-level field is a 400
naming it, and ``metadata`` / ``service_tier`` (Anthropic's user tracking and capacity tier, which
change nothing a self-hosted server returns) are accepted and ignored. Content blocks, tools and
tool_choice are checked one by one when the request is translated (anthropic_convert.py), so that
an unsupported block (an image, a document, thinking) is a 400 naming where it is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import _Request


class AnthropicModel(BaseModel):
    """A part of a request: strict types, no fields but Anthropic's."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class AnthropicMessage(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]  # text, or content blocks (anthropic_convert.py)


class _MessagesInput(_Request):
    """What decides the prompt: shared by /v1/messages and /v1/messages/count_tokens."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # "enabled" needs --reasoning-parser (anthropic_convert.py)
    # Anthropic's automatic cache breakpoint: accepted and ignored, the prefix cache here is automatic
    cache_control: dict[str, Any] | None = None


class CountTokensRequest(_MessagesInput):
    pass


class MessagesRequest(_MessagesInput):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: accepted, ignored
    service_tier: str | None = None  # accepted, ignored


# ---- content blocks, tools, tool_choice: validated one at a time (anthropic_convert.py) ---------
# cache_control (Anthropic's explicit cache breakpoints) is accepted on each and ignored: the
# prefix cache here is automatic, and the cache hits show as usage.cache_read_input_tokens.
# The fields the anthropic SDK's response blocks carry, which clients send back as they dump them
# (``block.model_dump()``: citations, caller, toolset_name, null when unused), are accepted too.
class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None  # the text's sources: the prompt gets the text only


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None  # who called the tool (a server tool): informational
    toolset_name: str | None = None


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolDefinition(AnthropicModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (bash, web search...) are not run here
    cache_control: dict[str, Any] | None = None


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool" only
    disable_parallel_tool_use: bool | None = None


# ---- response bodies, for the OpenAPI document only (the routes build plain dicts) -------------
class MessagesUsage(BaseModel):
    input_tokens: int  # prompt tokens not read from the cache (Anthropic's sum: input + cache_read)
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[dict[str, Any]]  # text and tool_use blocks
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Anthropic's error shape, which every error of the Messages endpoints has."""

    type: Literal["error"]
    error: AnthropicErrorDetail
