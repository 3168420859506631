"""Streaming a chat output under a tool plan: its content, and its tool calls as they are written.

One ``ToolCallStream`` per output, fed the output's (answer) text each time it grows; each step
gives the content delta and the call deltas, in the order of OpenAI's chat stream (and vLLM's):
a call's first delta carries its index, id and name (arguments ""), later ones fragments of its
arguments, which add up to the finished call's ``function.arguments``. The endpoints write them
in their own events (serving_chat.py, responses_streaming.py, anthropic_streaming.py).

Where a call's arguments are a JSON object the model writes (hermes, llama3_json, mistral, a
tool_choice "required" list) they stream as they are read, re-written as the finished call's are
(json_stream.py); a named tool_choice's arguments are the text itself; qwen3_xml and pythonic
give theirs a parameter at a time, as each value ends (the start of the finished arguments text).

The finished text decides (``ToolPlan.calls_of``): the calls and arguments not sent yet follow.
A call sent that the finished text does not bear out (cut by max_tokens, malformed after it began)
cannot be taken back: the stream then ends with the rest of the text as content, which no text
is lost to, and the calls stay as they were sent (``diverged``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from pagedllm.entrypoints.openai.tool_calls import ToolPlan
from pagedllm.entrypoints.openai.tool_parsers import ToolCall
from pagedllm.entrypoints.openai.tool_parsers.json_stream import JsonRewriter
from pagedllm.entrypoints.openai.tool_parsers.partial import PartialCall, header, object_calls

logger = logging.getLogger("pagedllm.server")

_REQUIRED_LIST = re.compile(r"\s*\[(?=\s*\{)")
_REQUIRED_HEADER = header("parameters")
_REQUIRED_BETWEEN = re.compile(r"\s*\}\s*,\s*(?=\{)")


@dataclass
class CallDelta:
    index: int
    arguments: str
    id: str | None = None  # id and name: on a call's first delta only
    name: str | None = None

    def to_openai(self) -> dict:
        """The delta as an entry of a chat chunk's ``delta.tool_calls``."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class StreamStep:
    content: str = ""  # sent before the step's calls
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class _Sent:
    id: str
    name: str
    arguments: str = ""
    rewriter: JsonRewriter | None = None


class ToolCallStream:
    def __init__(self, plan: ToolPlan | None) -> None:
        self.plan = plan
        self.content_len = 0  # characters of the text sent as content
        self.calls: list[ToolCall] = []  # the calls sent, final once finished
        self.diverged = False
        self.finished = False
        self._sent: list[_Sent] = []

    @property
    def has_calls(self) -> bool:
        """The finished output called tools as the stream sent them (finish_reason "tool_calls")."""
        return bool(self.calls) and not self.diverged

    def update(self, text: str, finished: bool) -> StreamStep:
        """The deltas of ``text`` (the output's answer so far; ``finished``: all of it)."""
        if self.finished:
            return StreamStep()
        plan, step = self.plan, StreamStep()
        if plan is None or plan.mode == "none":
            shown = len(text)
        else:
            self._grow(text, step.calls)
            shown = plan.streamable_len(text)
            if finished:
                _, final = plan.calls_of(text)
                self._settle(final, step.calls)
                if self.diverged or not final:
                    shown = len(text)
        self.finished = finished
        step.content = text[self.content_len : max(shown, self.content_len)]
        self.content_len = max(shown, self.content_len)
        self.calls = [ToolCall(s.name, s.arguments, s.id) for s in self._sent]
        return step

    def _partial(self, text: str) -> list[PartialCall]:
        plan = self.plan
        assert plan is not None
        try:
            if plan.mode == "named":
                return [PartialCall(plan.named, args_at=0, raw=True)] if text else []  # type: ignore[arg-type]
            if plan.mode == "required":
                listed = _REQUIRED_LIST.match(text)
                calls: list[PartialCall] = []
                if listed is not None:
                    object_calls(text, listed.end(), _REQUIRED_HEADER, _REQUIRED_BETWEEN, calls)
                return calls
            if plan.mode == "auto" and plan.parser is not None:
                return plan.parser.partial_calls(text, plan.tools)
        except Exception as e:  # a parser's bug: the calls come whole when the output ends
            logger.warning("streaming tool-call parsing failed (%s)", type(e).__name__)
        return []

    def _open(self, name: str, call_id: str, deltas: list[CallDelta]) -> _Sent:
        sent = _Sent(call_id, name)
        deltas.append(CallDelta(len(self._sent), "", id=call_id, name=name))
        self._sent.append(sent)
        return sent

    def _new_id(self) -> str:
        plan = self.plan
        return plan.parser.call_id() if plan is not None and plan.parser is not None else ToolCall("", "").id

    def _grow(self, text: str, deltas: list[CallDelta]) -> None:
        for i, pc in enumerate(self._partial(text)):
            if i < len(self._sent):
                sent = self._sent[i]
                if sent.name != pc.name:  # not what was found before: the finished text decides
                    return
            else:
                sent = self._open(pc.name, pc.call_id or self._new_id(), deltas)
            piece = ""
            if pc.raw and pc.args_at is not None:
                piece = text[pc.args_at + len(sent.arguments) :]
            elif pc.args_at is not None:
                sent.rewriter = sent.rewriter or JsonRewriter()
                piece = sent.rewriter.feed(text[pc.args_at :])
            elif pc.arguments is not None and pc.arguments.startswith(sent.arguments):
                piece = pc.arguments[len(sent.arguments) :]
            if piece:
                sent.arguments += piece
                deltas.append(CallDelta(i, piece))

    def _settle(self, final: list[ToolCall], deltas: list[CallDelta]) -> None:
        """The finished output's calls: the rest of each one sent, the ones not sent yet whole."""
        if len(final) < len(self._sent):
            self.diverged = True
            return
        for i, call in enumerate(final):
            if i < len(self._sent):
                sent = self._sent[i]
                if sent.name != call.name or not call.arguments.startswith(sent.arguments):
                    self.diverged = True
                    return
            else:
                sent = self._open(call.name, call.id, deltas)
            rest = call.arguments[len(sent.arguments) :]
            if rest:
                sent.arguments += rest
                deltas.append(CallDelta(i, rest))
