"""OpenAI request shapes (pydantic), the OpenAI error shape, and request -> SamplingParams.

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
"""

from __future__ import annotations

import logging
import re
import reprlib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

logger = logging.getLogger("pagedllm.server")
MAX_N = 128
MAX_JSON_DEPTH = 32  # deeper nesting than any real request has (chat_template_kwargs is free-form)


@dataclass
class ServerLimits:
    """Per-request caps, each a `pagedllm serve` flag (see cli.py). They bound the work and memory one
    request can cost the server before it is rejected with a 400 naming the field."""

    max_prompts_per_request: int = 256
    max_seqs_per_request: int = 1024  # prompts x max(n, best_of)
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_messages: int = 2048
    # prompt tokens + sequences x max_tokens, summed over the prompts; None: the KV cache's capacity
    max_request_tokens: int | None = None


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or ("server_error" if status_code >= 500 else "invalid_request_error")
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
            else:
                # Only what can hold a string or nest: a long token-id prompt costs one pass in C.
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


class _SamplingRequest(_IgnoredOpenAIFields):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None  # optional as in vLLM: defaults to the (first) served model
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
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


def error_from_value_error(e: Exception, fields: set[str]) -> APIError:
    """Maps a ValueError from SamplingParams / LLMEngine.add_request to a 400.

    SamplingParams' messages begin with the field name ("temperature must be >= 0, got -1."),
    which becomes ``param``; context-length errors get OpenAI's code.
    """
    msg = str(e)
    m = re.match(r"(\w+) ", msg)
    param = m.group(1) if m and m.group(1) in fields else None
    code = "context_length_exceeded" if "maximum context length" in msg else None
    return APIError(msg, 400, param=param, code=code)


_FIELDS = set(SamplingParams.__dataclass_fields__)


def to_sampling_params(
    req: _SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None,
    best_of: int | None = None,
    prompt_logprobs: int | None = None,
    defaults: dict[str, Any] | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Builds SamplingParams; omitted (None) fields take ``defaults`` (the model's generation config,
    see generation_defaults.py), else SamplingParams' (vLLM's) defaults. A default max_tokens caps
    the request's, as vLLM's max_new_tokens does.

    Raises APIError(400) naming the bad field. How many logprobs a request may ask for is the
    engine's max_logprobs, checked when the request is added.
    """
    defaults = defaults or {}
    default_max = defaults.get("max_tokens")
    if default_max is not None:
        max_tokens = default_max if max_tokens is None else min(max_tokens, default_max)
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise APIError(f"n must be between 1 and {MAX_N}, got {n}.", param="n")
    # Bounded here because the engine creates best_of sequences at once: 2**64 would hang it.
    if best_of is not None and not n <= best_of <= MAX_N:
        raise APIError(f"best_of must be between n ({n}) and {MAX_N}, got {best_of}.", param="best_of")
    if best_of is not None and best_of > n and req.stream:
        raise APIError("best_of > n cannot be streamed: the best n are only known at the end.", param="best_of")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise APIError(f"seed must fit in 64 bits, got {req.seed}.", param="seed")
    kwargs: dict[str, Any] = {
        "n": n,
        "best_of": best_of,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "min_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "logit_bias": _logit_bias(req.logit_bias),
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words": req.bad_words,
        "truncate_prompt_tokens": req.truncate_prompt_tokens,
        "structured_outputs": structured_outputs,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if kwargs[name] is None and name in defaults:
            kwargs[name] = defaults[name]
    # max_tokens=None is meaningful (the rest of the context); every other None means "default".
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in ("max_tokens", "logprobs", "best_of")}
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise error_from_value_error(e, _FIELDS) from e


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if bias is None:
        return None
    out = {}
    for k, v in bias.items():
        try:
            out[int(k)] = v
        except ValueError:
            raise APIError(
                f"logit_bias keys must be token ids (integers as strings), got {_short(k)}.", param="logit_bias"
            ) from None
    return out


def validation_error_message(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message (and the offending field) from pydantic/FastAPI validation errors."""
    by_field: dict[str, list[dict]] = {}
    for err in errors:
        if err.get("type") == "prompt_or_messages":
            return str(err.get("msg")), "prompt"
        if err.get("type") in ("invalid_unicode", "too_deep"):  # check_json_value's: already readable
            param = (err.get("ctx") or {}).get("param")
            return str(err.get("msg")), (None if param == "body" else param)
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "extra_forbidden" and len(loc) == 1:
            top = ([x for x in e.get("loc", ()) if x != "body"] for e in errors if e.get("type") == "extra_forbidden")
            unknown = [str(t[0]) for t in top if len(t) == 1]
            names = ", ".join(f"'{n}'" for n in unknown)
            return (
                f"Unsupported request field(s) {names}: this server cannot honour them, and does not "
                "ignore fields that could change the result.",
                unknown[0],
            )
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"The request body is not valid JSON{': ' + str(detail) if detail else ''}.", None
        by_field.setdefault(loc[0] if loc else "", []).append(err)
    parts = []
    for field, errs in by_field.items():
        if not field:
            e = errs[0]
            if e.get("type") == "missing":
                parts.append("The request body must be a JSON object.")
            else:
                parts.append(f"Invalid request body: {e.get('msg')}.")
            continue
        e = errs[0]
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "missing":
            parts.append(f"'{loc}' is a required property.")
        elif len(errs) > 1:  # a union field: every alternative failed
            parts.append(f"Invalid type for '{field}': got {_short(e.get('input'))} ({e.get('msg')}).")
        else:
            parts.append(f"Invalid value for '{loc}': {e.get('msg')} (got {_short(e.get('input'))}).")
    first = next(iter(by_field), None)
    return " ".join(parts) or "Invalid request.", first or None


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxstring, _REPR.maxlist, _REPR.maxdict, _REPR.maxother = 40, 6, 4, 40


def _short(value: Any) -> str:
    """A bounded repr: the offending value may be a megabyte-long list."""
    return _REPR.repr(value)
