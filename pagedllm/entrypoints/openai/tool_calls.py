"""OpenAI's tool calling on /v1/chat/completions: ``tools`` + ``tool_choice``.

- ``none``: the tools reach the chat template (as vLLM), the answer is text.
- ``auto``: the model writes freely; the server's tool-call parser (``--enable-auto-tool-choice
  --tool-call-parser NAME``) turns the calls it wrote into ``tool_calls``.
- ``required`` / a named function: the output is constrained (structured outputs) to a JSON list
  of calls / that function's arguments, so the calls always parse and their arguments always
  match the tool's parameter schema.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.tool_parsers import ToolCall, ToolParser, call_of, loads
from pagedllm.structured_output import StructuredOutputsParams

logger = logging.getLogger("pagedllm.server")

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # as given: what the chat template receives
    named: str | None = None
    constraint: StructuredOutputsParams | None = None
    parser: ToolParser | None = None

    def calls_of(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output. Never raises: text that does not parse as
        calls (cut by max_tokens, a constraint that ended early, nesting deeper than Python
        parses) is the content."""
        if self.mode == "named":
            return None, [ToolCall(self.named, text)]
        try:
            if self.mode == "required":
                calls = _required_calls(text)
                return (None, calls) if calls else (text, [])
            if self.mode == "auto" and self.parser is not None:
                return self.parser.extract(text, self.tools)
        except Exception as e:  # a parser's bug must not lose the answer: it is still the text
            logger.warning("tool-call parsing failed (%s); the output is returned as content", type(e).__name__)
        return text, []

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output must keep special tokens: the parser's markers are some."""
        return self.mode == "auto" and self.parser is not None and self.parser.keeps_special_tokens

    def streamable_len(self, text: str) -> int:
        """Leading characters of a partial output that are content whatever follows."""
        if self.mode in ("named", "required"):
            return 0
        if self.mode == "auto" and self.parser is not None:
            return self.parser.streamable_len(text)
        return len(text)


def _required_calls(text: str) -> list[ToolCall]:
    """The calls of a tool_choice "required" output ([{"name": ..., "parameters": {...}}, ...]),
    or [] if it is not that."""
    try:
        items = loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = [call_of(c, "parameters") if isinstance(c, dict) and "parameters" in c else None for c in items]
    return calls if calls and all(c is not None for c in calls) else []  # type: ignore[return-value]


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _check_tools(tools: list[dict[str, Any]]) -> None:
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}.", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}.", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object.", param="tools")


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parser: ToolParser | None,
    auto_enabled: bool,
    parallel: bool = True,
) -> ToolPlan | None:
    """What a request's tools and tool_choice ask for; 400s name the field (vLLM's rules).
    ``parallel``: OpenAI's parallel_tool_calls; False: at most one call (required: exactly one)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError("tool_choice needs tools.", param="tool_choice")
        return None
    _check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise APIError(
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}.",
                param="tool_choice",
            )
        match = [t for t in tools if t["function"]["name"] == name]
        if not match:
            raise APIError(f"tool_choice names {name!r}, which is not among the tools.", param="tool_choice")
        constraint = StructuredOutputsParams(json=_parameters(match[0]))
        return ToolPlan("named", tools, named=name, constraint=constraint)
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "required":
        calls = {
            "type": "array",
            "minItems": 1,
            **({} if parallel else {"maxItems": 1}),
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for t in tools
                ]
            },
        }
        return ToolPlan("required", tools, constraint=StructuredOutputsParams(json=calls))
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set.',
                param="tool_choice",
            )
        return ToolPlan("auto", tools, parser=parser)
    raise APIError(
        f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}.", param="tool_choice"
    )


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls' arguments as objects, as chat templates iterate them (vLLM does the
    same); OpenAI clients send them as JSON text."""
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = loads(fn["arguments"])
                except ValueError:
                    pass  # the template gets the text as the client sent it
    return messages


def assistant_message(plan: ToolPlan | None, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The assistant message of a finished output, and its finish_reason: "tool_calls" when the
    model called tools (and was not cut short)."""
    if plan is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = plan.calls_of(text)
    if not calls:
        return {"role": "assistant", "content": content}, finish_reason
    message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason
