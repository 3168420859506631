"""``qwen3_xml`` (also ``qwen3_coder``; Qwen3-Coder, Qwen3-Next...): XML-like calls, text before
the first is content::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; it becomes the type the tool's JSON schema gives that parameter
(integer, number, boolean, object, array, null), and stays a string where the schema says so,
says nothing, or the text is not of that type. A parameter named twice keeps its first value.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import (
    MarkedToolParser,
    ToolCall,
    arguments_json,
    loads,
)
from pagedllm.entrypoints.openai.tool_parsers.partial import PartialCall

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*|$)", re.S)
# A parameter ends at its closing tag, or (the tag left out) where the next one or the end begins.
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
_FUNCTION_OPEN = re.compile(r"\s*<function=([^>\n]+)>")
_NOT_CONVERTED = object()
_JSON_TYPE = {bool: "boolean", int: "integer", float: "number", type(None): "null", dict: "object", list: "array"}


def _types(schema: object) -> list[str]:
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    for key in ("anyOf", "oneOf"):  # Optional[int] and the like: the union of the branches' types
        if isinstance(schema.get(key), list):
            return [k for branch in schema[key] for k in _types(branch)]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return sorted({_JSON_TYPE.get(type(v), "string") for v in enum})
    return []


def _as_type(value: str, kind: str) -> object:
    """``value`` as the JSON schema type ``kind``, or _NOT_CONVERTED."""
    text = value.strip()
    try:
        if kind == "integer":
            n = loads(text)
            if isinstance(n, float) and n.is_integer():
                n = int(n)
            return n if isinstance(n, int) and not isinstance(n, bool) else _NOT_CONVERTED
        if kind == "number":
            n = loads(text)
            ok = isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n)
            return n if ok else _NOT_CONVERTED
        if kind == "boolean":
            return {"true": True, "false": False}.get(text.lower(), _NOT_CONVERTED)
        if kind == "null":
            return None if text.lower() in ("null", "none") else _NOT_CONVERTED
        if kind in ("object", "array"):
            want = dict if kind == "object" else list
            try:
                obj = loads(text)
            except ValueError:  # models also write Python literals ({'a': 1}, True)
                obj = ast.literal_eval(text)
            arguments_json({"v": obj})  # must be JSON
            return obj if isinstance(obj, want) else _NOT_CONVERTED
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        pass
    return _NOT_CONVERTED


def convert(value: str, schema: object) -> object:
    """A parameter's text as its schema types it (the text itself if none fits)."""
    kinds = _types(schema)
    if not kinds and isinstance(schema, dict) and schema:  # typed another way ($ref...): JSON if it reads
        kinds = ["object", "array"]
    for kind in sorted(kinds, key=lambda k: k == "string"):  # string last: the fallback
        if kind == "string":
            return value
        got = _as_type(value, kind)
        if got is not _NOT_CONVERTED:
            return got
    return value


def _properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def _parameters(body: str, props: dict[str, Any], closed_only: bool) -> tuple[dict[str, object], int] | None:
    """The typed arguments of a function's ``body`` and where they end, or None if text stands
    between parameters. ``closed_only``: only the parameters the text has closed (by their tag,
    or the next one's opening), as a partial output's are. A repeated parameter keeps its first
    value, so what streamed of a call never changes when its text goes on."""
    args: dict[str, object] = {}
    pos = 0
    for p in _PARAMETER.finditer(body):
        if p.start() != pos:  # text between parameters: not this format
            return None
        if closed_only and not (body.endswith("</parameter>", 0, p.end()) or body.startswith("<parameter=", p.end())):
            break
        pos = p.end()
        value = p.group(2)
        # The template writes each value on its own lines: one newline each side is the format's.
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        key = p.group(1).strip()
        if key not in args:
            args[key] = convert(value, props.get(key))
    return args, pos


def _call(block: str, tools: list[dict[str, Any]] | None) -> ToolCall | None:
    m = _FUNCTION.fullmatch(block.strip() + "\n")
    if m is None:
        return None
    name, body = m.group(1).strip(), m.group(2)
    parsed = _parameters(body, _properties(tools, name), closed_only=False)
    if parsed is None or body[parsed[1] :].strip():
        return None
    return ToolCall(name, arguments_json(parsed[0]))


def _arguments_so_far(text: str, body_at: int, name: str, tools: list[dict[str, Any]] | None) -> str | None:
    """The start of an open call's arguments text, up to its last closed parameter (None: none
    closed yet, or the text is not this format): the finished call's arguments begin with it."""
    parsed = _parameters(text[body_at:], _properties(tools, name), closed_only=True)
    if not parsed or not parsed[0]:
        return None
    return arguments_json(parsed[0])[:-1]  # without the object's closing brace


class Qwen3XmlToolParser(MarkedToolParser):
    name = "qwen3_xml"
    START, END = "<tool_call>", "</tool_call>"

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        try:
            for m in _BLOCK.finditer(text, start):
                call = _call(m.group(1), tools)
                if call is None:  # a malformed call: the answer is text, as the model wrote it
                    return text, []
                calls.append(call)
        except ValueError:  # arguments JSON cannot carry
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def partial_calls(self, text: str, tools: list[dict[str, Any]] | None = None) -> list[PartialCall]:
        """A call opens at its function's name; its typed arguments stream a parameter at a time,
        as each closes."""
        calls: list[PartialCall] = []
        start = text.find(self.START)
        while start >= 0:
            body = start + len(self.START)
            m = _FUNCTION_OPEN.match(text, body)
            if m is None:
                break
            name = m.group(1).strip()
            end = text.find(self.END, m.end())
            if end < 0:
                try:
                    calls.append(PartialCall(name, arguments=_arguments_so_far(text, m.end(), name, tools)))
                except ValueError:  # arguments JSON cannot carry: the finished text decides
                    calls.append(PartialCall(name))
                break
            try:
                call = _call(text[body:end], tools)
            except ValueError:
                call = None
            if call is None:  # malformed: the finished text decides
                break
            calls.append(PartialCall(call.name, arguments=call.arguments))
            start = text.find(self.START, end)
        return calls


class Qwen3CoderToolParser(Qwen3XmlToolParser):
    name = "qwen3_coder"  # vLLM's other name for the same format
