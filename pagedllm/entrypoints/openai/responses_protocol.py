"""The request body of OpenAI's Responses API (``POST /v1/responses``), checked field by field.

As for the other endpoints (protocol.py): types are strict, unknown fields are a 400 naming
them, and a field OpenAI defines that this server cannot honour (built-in tools, background
runs, reasoning effort without a reasoning parser, prompt templates...) is a 400 naming it
rather than ignored. The fields that only steer OpenAI's own service (user, service_tier,
safety_identifier, prompt_cache_key) are accepted and change nothing, as on chat.

``input`` items, ``tools``, ``tool_choice`` and ``text`` are kept as JSON here and read by
responses_input.py, whose errors name the item at fault.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import SamplingFields, _Request

# OpenAI's bounds on metadata
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


class ResponsesRequest(_Request, SamplingFields):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=128)
    store: bool | None = True  # OpenAI's default: kept for retrieval and previous_response_id
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no obfuscation is ever sent
    metadata: dict[str, str] | None = None  # echoed on the response, as OpenAI does
    # Tools (function tools only) and structured output
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None  # sampling: this and SamplingFields' (as on chat)
    # Accepted and ignored: OpenAI's service steering, nothing a local server returns depends on them
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Defined by OpenAI, refused unless left at their defaults (unsupported_fields)
    truncation: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None


# OpenAI's reasoning options: accepted with a reasoning parser, where they change nothing (the
# model reasons as its chat template makes it), and echoed on the response
_REASONING_FIELDS = {"effort", "summary", "generate_summary"}


def _refusals(req: ResponsesRequest, reasoning_parser: bool) -> list[tuple[str, bool, str]]:
    """(field, whether the request asks for what is not supported, why)."""
    reasoning = {k: v for k, v in (req.reasoning or {}).items() if v is not None}
    unknown = sorted(set(reasoning) - _REASONING_FIELDS)
    return [
        ("reasoning", bool(unknown), f"unknown field(s) {', '.join(unknown)}; effort and summary are accepted"),
        ("truncation", req.truncation not in (None, "disabled"), "only 'disabled' is supported"),
        ("background", bool(req.background), "background responses are not supported"),
        ("reasoning", bool(reasoning) and not reasoning_parser, "this server has no reasoning parser for the model"),
        ("include", bool(req.include), "no extra output data (logprobs, encrypted reasoning) is available"),
        ("top_logprobs", bool(req.top_logprobs), "output logprobs are not supported on /v1/responses"),
        ("max_tool_calls", req.max_tool_calls is not None, "the server runs no tools itself"),
        ("prompt", req.prompt is not None, "stored prompt templates are not supported"),
        ("conversation", req.conversation is not None, "conversations are not supported; use previous_response_id"),
    ]


def check_supported(req: ResponsesRequest, reasoning_parser: bool = False) -> None:
    """A 400 naming the first field the request sets that this server cannot honour, or
    metadata over OpenAI's bounds (it is stored and echoed). ``reasoning_parser``: the server
    has one, so ``reasoning`` is accepted."""
    for field, asked, why in _refusals(req, reasoning_parser):
        if asked:
            raise APIError(f"'{field}' is not supported: {why}.", param=field)
    metadata = req.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS or any(
        len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS for k, v in metadata.items()
    ):
        raise APIError(
            f"metadata may hold at most {MAX_METADATA_PAIRS} pairs, keys of at most {MAX_METADATA_KEY_CHARS} "
            f"characters and values of at most {MAX_METADATA_VALUE_CHARS}.",
            param="metadata",
        )
