"""OpenAI request shapes (pydantic): what a request body may hold, checked field by field.

A request field is either declared (and honoured), one of IGNORED_FIELDS (harmless OpenAI fields
that change nothing a self-hosted server returns: accepted, and logged at debug level as vLLM
does), or a 400 naming it (``extra="forbid"``): a field silently dropped would return something
other than what the client asked for. Nested objects (stream_options, content parts) still ignore
what they do not know. Fields that have a default also accept an explicit ``null`` meaning "the
default", because some clients send nulls.

Types are strict (``strict=True``): ``"n": "2"``, ``"max_tokens": 2.0`` or ``"stream": 1`` are 400s
naming the field, as OpenAI answers them, rather than silently coerced (lax coercion hides client
bugs, and ``"echo": "false"`` would mean True). A JSON integer is still a valid float
(``"temperature": 1``): strict pydantic accepts int for float.

The error shape these requests are answered with is errors.py; how a request becomes the
engine's SamplingParams is sampling.py; the per-request caps of the server are limits.py.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

logger = logging.getLogger("pagedllm.server")
MAX_JSON_DEPTH = 32  # deeper nesting than any real request has (chat_template_kwargs is free-form)
# JSON values that hold no string (exact types: a str subclass must still be checked)
_SCALARS = frozenset({int, float, bool, type(None)})


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


def check_json_value(value: Any) -> None:
    """Rejects what JSON can carry but nothing downstream handles: lone UTF-16 surrogates ("\\ud800"
    parses to a str that cannot be encoded, so tokenizers and the response encoder would raise) and
    absurd nesting. Iterative, so a deep document cannot exhaust the stack. Raises a pydantic error
    whose ctx names the top-level field."""
    stack: list[tuple[Any, int, str | None]] = [(value, 0, None)]
    while stack:
        v, depth, field = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise PydanticCustomError(
                    "invalid_unicode",
                    "Invalid value for '{param}': the string is not valid Unicode (a lone UTF-16 surrogate).",
                    {"param": field or "body"},
                ) from None
        elif isinstance(v, (list, dict)):
            if depth >= MAX_JSON_DEPTH:
                raise PydanticCustomError(
                    "too_deep",
                    "Invalid value for '{param}': nested deeper than {max_depth} levels.",
                    {"param": field or "body", "max_depth": MAX_JSON_DEPTH},
                )
            if isinstance(v, dict):
                for k, x in v.items():
                    top = field if field is not None else (k if isinstance(k, str) else None)
                    stack.append((k, depth + 1, top))
                    stack.append((x, depth + 1, top))
            elif not _SCALARS.issuperset(map(type, v)):  # a list of numbers (token ids): one pass in C
                # Only what can hold a string or nest.
                stack.extend((x, depth + 1, field) for x in v if isinstance(x, (str, list, dict)))


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


# OpenAI request fields accepted and ignored: they steer OpenAI's own storage, billing, abuse
# tracking or latency, never the tokens returned. Declared on the requests (typed as OpenAI types
# them) so that they pass extra="forbid" and appear in the OpenAPI document.
IGNORED_FIELDS = (
    "user",
    "store",
    "metadata",
    "service_tier",
    "prediction",
    "prompt_cache_key",
    "safety_identifier",
)


class _Request(OpenAIBaseModel):
    """A request body: unknown top-level fields are a 400 naming them (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_json_values(cls, data: Any) -> Any:
        check_json_value(data)
        return data


class _IgnoredOpenAIFields(_Request):
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None  # honoured by tool_choice "required" (tool_calls.py)
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _log_ignored(self) -> _IgnoredOpenAIFields:
        ignored = [f for f in IGNORED_FIELDS if f in self.model_fields_set]
        if ignored:
            logger.debug("request fields accepted and ignored: %s", ", ".join(ignored))
        return self


class SamplingFields(BaseModel):
    """The sampling fields every generation endpoint takes (/v1/responses too). No config of its
    own: a request class's (strict, extra="forbid") applies, whatever the order of its bases."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None


class _SamplingRequest(_IgnoredOpenAIFields, SamplingFields):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None  # optional as in vLLM: defaults to the (first) served model
    n: int | None = 1
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    spaces_between_special_tokens: bool | None = True
    # Token controls (vLLM's extras but logit_bias, OpenAI's: token id string -> bias in [-100, 100])
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's extra parameter: prompt_logprobs (None, then one dict per prompt token); on a
    # completions choice, or on the chat response
    prompt_logprobs: int | None = None
    # Output constraints (structured.py): OpenAI's response_format, vLLM's structured_outputs, and
    # vLLM's older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # one grammar engine here (llguidance): any name runs it
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    # Order matters for pydantic's union: exact matches win, then the first that validates.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


class TextContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # name, tool_call_id, ...: passed to the template; role and content typed strictly as above
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextContentPart] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's tool calling (tool_calls.py): [{"type": "function", "function": {name, description,
    # parameters}}]; "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a ``prompt``, or chat ``messages`` rendered by the chat template first."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's defaults: True for a prompt, False for messages (the template has the special tokens)
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("prompt_or_messages", "Give exactly one of 'prompt' and 'messages'.")
        return self


class DetokenizeRequest(_Request):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]
