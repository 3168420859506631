"""The new tool-call parsers behind a real server, through the `openai` client: the tiny model
(random weights) is made to write a call in the parser's format (structured outputs' ``choice``),
and the server returns it as ``tool_calls``, whole and streamed, with the text before it as
content and the call's marker nowhere in it."""

from __future__ import annotations

import json

import openai
import pytest
from test_server import served
from test_server_structured import TIME, WEATHER, chat_stream_text

MODEL = "tiny"
CONTENT = "Let me check."
WRITTEN = {  # what a model using each format writes: the text, then two calls
    "hermes": CONTENT + '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>',
    "mistral": CONTENT + '[TOOL_CALLS]get_time[ARGS]{"zone": 2}[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", '
    '"unit": "c"}',
    "pythonic": '[get_time(zone=2), get_weather(city="Zürich", unit="c")]',
    "qwen3_xml": CONTENT + "\n<tool_call>\n<function=get_time>\n<parameter=zone>\n2\n</parameter>\n</function>\n"
    "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=unit>\n"
    "c\n</parameter>\n</function>\n</tool_call>",
}
CALLS = [("get_time", {"zone": 2}), ("get_weather", {"city": "Zürich", "unit": "c"})]


@pytest.fixture(scope="module", params=sorted(WRITTEN))
def parser_client(request, tiny_llama, tmp_path_factory):
    with served(
        tiny_llama,
        tmp_path_factory,
        "--served-model-name",
        MODEL,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        request.param,
    ) as srv:
        yield request.param, openai.OpenAI(base_url=srv.url("/v1"), api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_the_formats_calls_come_back_as_tool_calls(parser_client, stream):
    name, client = parser_client
    kw = dict(
        messages=[{"role": "user", "content": "Time and weather in Zürich?"}],
        tools=[TIME, WEATHER],
        tool_choice="auto",
        max_tokens=400,
        extra_body={"structured_outputs": {"choice": [WRITTEN[name]]}},
    )
    expected_content = None if name == "pythonic" else CONTENT
    if stream:
        content, calls, finish = chat_stream_text(client, **kw)
        assert content.strip() == (expected_content or "")
        got = [(c["name"], json.loads(c["arguments"])) for c in calls]
    else:
        choice = client.chat.completions.create(model=MODEL, **kw).choices[0]
        assert choice.message.content == expected_content
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        finish = choice.finish_reason
        calls = [{"id": c.id} for c in choice.message.tool_calls]
    assert got == CALLS and finish == "tool_calls"
    if name == "mistral":  # ids its chat templates accept back
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)


def test_streamed_calls_open_then_their_arguments_grow(parser_client):
    """OpenAI's (and vLLM's) stream: a call's first delta has its index, id, type and name with
    no arguments; the arguments follow in fragments (several, for formats of JSON arguments)."""
    name, client = parser_client
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Time and weather in Zürich?"}],
        tools=[TIME, WEATHER],
        tool_choice="auto",
        max_tokens=400,
        stream=True,
        extra_body={"structured_outputs": {"choice": [WRITTEN[name]]}},
    )
    deltas = [tc for chunk in stream for ch in chunk.choices for tc in ch.delta.tool_calls or []]
    for index, (fn, _) in enumerate(CALLS):
        mine = [d for d in deltas if d.index == index]
        first, rest = mine[0], mine[1:]
        assert first.id and first.type == "function" and first.function.name == fn
        assert first.function.arguments == ""
        assert all(d.id is None and d.function.name is None for d in rest)
        fragments = [d.function.arguments for d in rest]
        assert json.loads("".join(fragments)) == CALLS[index][1]
        if name in ("hermes", "mistral"):
            assert len(fragments) > 2
