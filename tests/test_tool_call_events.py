"""/v1/messages' stream of auto-parsed tool calls, driven by a scripted engine stream (a model of
random weights does not write calls): the text streams as text_delta, each call opens a tool_use
block and its input arrives as input_json_delta fragments as the model writes it; the SDK's own
event types parse every event, and its accumulator rebuilds the non-streamed message."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from pagedllm.entrypoints.openai.anthropic_convert import ChatTranslation
from pagedllm.entrypoints.openai.anthropic_streaming import message_events
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningSplit
from pagedllm.entrypoints.openai.serving_chat import PreparedChat
from pagedllm.entrypoints.openai.tool_calls import ToolPlan
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser

EVENTS = TypeAdapter(RawMessageStreamEvent)
TEXT = (
    'Checking. <tool_call>{"name": "get_time", "arguments": {"zone": 2}}</tool_call>'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}</tool_call>'
)


class ScriptedStream:
    """An engine stream that hands over ``text`` a few characters at a time, then finishes."""

    def __init__(self, text: str, step: int) -> None:
        self.text, self.step = text, step

    async def _outputs(self):
        cuts = [*range(self.step, len(self.text), self.step), len(self.text)]
        for n, cut in enumerate(cuts, 1):
            finished = cut == len(self.text)
            output = SimpleNamespace(
                text=self.text[:cut], token_ids=list(range(n)), finish_reason="stop" if finished else None
            )
            output.stop_reason = None
            yield SimpleNamespace(outputs=[output], num_cached_tokens=0)

    def __aiter__(self):
        return self._outputs()

    def abort(self) -> None:
        pass


class Serving:
    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        return ReasoningSplit(None, text)


def events_of(step: int, parallel: bool = True) -> list[dict]:
    plan = ToolPlan("auto", [], parser=HermesToolParser())
    prep = PreparedChat("tiny", plan, None, {"prompt_token_ids": [1, 2, 3]}, None)  # type: ignore[arg-type]
    translation = ChatTranslation(None, False, parallel_tool_calls=parallel)  # type: ignore[arg-type]

    async def collect() -> list[str]:
        stream = message_events(Serving(), "msg_1", [ScriptedStream(TEXT, step)], prep, translation)  # type: ignore[arg-type]
        return [e async for e in stream]

    return [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(collect())]


def test_auto_tool_calls_stream_their_input_as_written():
    for step in (1, 3, 17, len(TEXT)):
        data = events_of(step)
        snapshot, bufs = None, {}
        for d in data:
            if d["type"] == "ping":  # not among the SDK's message events; its client skips it
                continue
            snapshot = accumulate_event(event=EVENTS.validate_python(d), current_snapshot=snapshot, json_bufs=bufs)
        text, *uses = snapshot.content
        assert text.type == "text" and text.text.strip() == "Checking."
        assert [(u.name, u.input) for u in uses] == [
            ("get_time", {"zone": 2}),
            ("get_weather", {"city": "Zürich", "unit": "c"}),
        ]
        assert snapshot.stop_reason == "tool_use"
        fragments = [d["delta"]["partial_json"] for d in data if d["type"] == "content_block_delta" and d["index"] == 2]
        assert json.loads("".join(fragments)) == {"city": "Zürich", "unit": "c"}
        if step == 1:  # written as the model writes it, not in one piece at the end
            assert len(fragments) > 5


def test_without_parallel_calls_only_the_first_is_sent():
    data = events_of(4, parallel=False)
    starts = [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"]
    assert starts == ["text", "tool_use"]
