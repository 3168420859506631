"""A Responses request as a chat request: its input items as chat messages, its function tools,
tool_choice and ``text.format`` in chat's spelling.

/v1/responses runs on the chat path (serving_chat.py): the chat template, tool plans, structured
outputs, sampling conversion and the server's caps are chat's. This module only translates, and
refuses with a 400 naming the item what chat cannot carry (images, files, built-in tools).

- a message item (``{"role", "content"}``, content a string or input_text / output_text parts)
  is a chat message; role ``developer`` becomes ``system``, as templates know no developer role;
- ``function_call`` items become an assistant message's ``tool_calls`` (consecutive calls, and
  calls right after an assistant message, join that message, as chat writes parallel calls);
- ``function_call_output`` items become ``tool`` messages answering their ``call_id``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import APIError, short_repr, validation_error_message
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, SamplingFields
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")
# Chat's names of the fields its errors name -> this endpoint's
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}
# How chat's messages name those fields -> how this endpoint's request spells them
_WORDS = {"response_format": "text.format", "max_tokens": "max_output_tokens"}


def _item_error(i: int, message: str) -> APIError:
    return APIError(f"input[{i}]: {message}", param="input")


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _item_error(i, f"a {item.get('type')} item needs '{key}' as a string, got {short_repr(value)}.")
    return value


def _text(content: Any, i: int) -> str:
    """A message's content as one string: text parts joined by newlines, as chat joins them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _item_error(i, f"content must be a string or a list of text parts, got {short_repr(content)}.")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _item_error(
                i, f"content[{j}] of type {short_repr(kind)} is not supported; only input_text and output_text are."
            )
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]], reasoning: bool = False) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input`` (a string is one user message). ``reasoning``:
    the server has a reasoning parser, so reasoning items (earlier output sent back) are taken."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _item_error(i, f"role must be one of {', '.join(_ROLES)}, got {short_repr(role)}.")
            messages.append({"role": _ROLES[role], "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            function = {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}
            call = {"id": _string(item, "call_id", i), "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # a new dict: history is shared
                messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", []), call]}
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "reasoning" and reasoning:
            # chat templates of reasoning models leave earlier turns' reasoning out of the prompt
            continue
        elif kind == "function_call_output":
            output = _text(item.get("output"), i)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": output})
        else:
            raise _item_error(
                i,
                f"items of type {short_repr(kind)} are not supported; only message, function_call and "
                "function_call_output are.",
            )
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools ({"type", "name", "parameters", ...}) in chat's shape."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(
                f"tools[{i}]: tools of type {short_repr(kind)} are not supported; only 'function' tools are "
                "(this server runs no built-in tools).",
                param="tools",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice  # "none" | "auto" | "required": chat checks them
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}; "
            f"got {short_repr(choice)}.",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def text_format(text: dict[str, Any] | None) -> dict[str, Any]:
    """The request's ``text.format`` ({"type": "text"} when absent), checked."""
    text = text or {}
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise APIError(f"text has unsupported field(s) {', '.join(unknown)}.", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise APIError("text.verbosity is not supported: answers are as long as the model makes them.", param="text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(
            f"text.format.type must be 'text', 'json_object' or 'json_schema', got {short_repr(kind)}.", param="text"
        )
    if kind == "json_schema" and (not isinstance(fmt.get("schema"), dict) or not isinstance(fmt.get("name"), str)):
        raise APIError("text.format json_schema needs 'name' (a string) and 'schema' (an object).", param="text")
    return fmt


def _response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    if fmt["type"] != "json_schema":
        return None if fmt["type"] == "text" else {"type": fmt["type"]}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]], reasoning: bool = False
) -> tuple[list[dict], ChatCompletionRequest]:
    """(the conversation so far: ``history`` + this input, without instructions; the chat request
    that answers it). ``instructions`` lead as a system message, for this response only, as OpenAI
    does not carry them over to the next response. ``reasoning``: see input_messages."""
    conversation = [*history, *input_messages(req.input, reasoning)]
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    fields = {
        "model": req.model,
        "messages": [*system, *conversation],
        "max_completion_tokens": req.max_output_tokens,
        "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(text_format(req.text)),
        "stream": req.stream,
        **{k: getattr(req, k) for k in SamplingFields.model_fields},
    }
    with responses_params():
        try:
            chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            message, param = validation_error_message(list(e.errors()))
            raise APIError(message, param=param) from e
    return conversation, chat


@contextmanager
def responses_params() -> Iterator[None]:
    """Chat's 400s in this endpoint's words: the field they name as a Responses request spells it."""
    try:
        yield
    except APIError as e:
        e.param = _PARAMS.get(e.param or "", e.param)
        for chat_word, word in _WORDS.items():
            e.message = e.message.replace(chat_word, word)
        raise
