"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client against `pagedllm serve`.

Every answer and event is also validated strictly against the SDK's own pydantic types (the SDK
itself builds its objects without validating). The tiny model's weights are random: what is
asserted is what the server decides (the prompt it renders, stop sequences, forced tool calls,
usage), checked against the chat endpoint and the tokenizer rather than against fixed text.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from pydantic import TypeAdapter
from test_server import served

MODEL = "tiny"
KEY = "sk-messages-test"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA},
    {
        "name": "get_time",
        "input_schema": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
]
SYSTEM = "You are a terse assistant."
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
EVENTS = TypeAdapter(RawMessageStreamEvent)
# Newer SDKs no longer take sampling fields as arguments; older clients send them in the body.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    with served(
        tiny_llama,
        tmp_path_factory,
        "--served-model-name",
        MODEL,
        "--num-kv-blocks",
        "1024",
        "--api-key",
        KEY,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--max-request-body-bytes",
        "200000",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=120)


def create(client, **kw) -> Message:
    """messages.create, with the raw body validated strictly against the SDK's Message."""
    raw = client.messages.with_raw_response.create(model=MODEL, **kw)
    Message.model_validate(raw.http_response.json())
    return raw.parse()


def raw_events(server, **body) -> list[dict]:
    """A streamed answer's events as sent: each validated against the SDK's event types, and its
    SSE event name equal to its type."""
    events = []
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream(
        "POST", server.url("/v1/messages"), json={"model": MODEL, "stream": True, **body}, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name
                if name not in ("ping", "error"):
                    EVENTS.validate_python(data)
                events.append(data)
    return events


def text_of(message: Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def check_event_order(events: list[dict]) -> None:
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    open_index = None
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None
            open_index = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            open_index = None
    assert open_index is None


def test_create_matches_the_chat_endpoint(client, chat_client):
    msg = create(client, max_tokens=12, system=SYSTEM, messages=USER, **GREEDY)
    chat = chat_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *USER],
        max_tokens=12,
        temperature=0,
    )
    # The same prompt, greedy: the same text and counts.
    assert text_of(msg) == chat.choices[0].message.content
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.model == MODEL
    count = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=USER)
    MessageTokensCount.model_validate(count.model_dump())
    assert count.input_tokens == chat.usage.prompt_tokens


def test_system_as_text_blocks_is_the_system_string(client):
    blocks = [
        {"type": "text", "text": "You are"},
        {"type": "text", "text": "terse.", "cache_control": {"type": "ephemeral"}},
    ]
    as_blocks = client.messages.count_tokens(model=MODEL, system=blocks, messages=USER)
    as_string = client.messages.count_tokens(model=MODEL, system="You are\nterse.", messages=USER)
    assert as_blocks.input_tokens == as_string.input_tokens


def test_stream_matches_create(client, server):
    kw = {"max_tokens": 12, "system": SYSTEM, "messages": USER}
    plain = create(client, **kw, **GREEDY)
    with client.messages.stream(model=MODEL, **kw, **GREEDY) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == text_of(plain) == text_of(final)
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    events = raw_events(server, temperature=0, **kw)
    check_event_order(events)
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == text_of(plain)
    start, delta = events[0]["message"], events[-2]
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == (
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    )
    assert delta["delta"]["stop_reason"] == plain.stop_reason


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client, stream):
    kw = {"max_tokens": 24, "messages": USER, **GREEDY}
    text = text_of(create(client, **kw))
    assert len(text) >= 8, text
    stop = text[4:7]
    expected = text[: text.find(stop)]
    if stream:
        with client.messages.stream(model=MODEL, stop_sequences=[stop], **kw) as s:
            msg = s.get_final_message()
    else:
        msg = create(client, stop_sequences=[stop], **kw)
    assert text_of(msg) == expected
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop


def check_weather_call(msg: Message) -> dict:
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather", msg.content
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    assert msg.stop_reason == "tool_use" and uses[0].id.startswith("toolu_")
    return uses[0]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_and_tool_result_turns(client, server, stream):
    choice = {"type": "tool", "name": "get_weather"}
    kw = {"max_tokens": 160, "tools": TOOLS, "tool_choice": choice, "messages": USER}
    if stream:
        with client.messages.stream(model=MODEL, **kw) as s:
            msg = s.get_final_message()
        events = raw_events(server, **kw)
        check_event_order(events)
        assert events[1]["type"] == "ping"
        json_deltas = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
        assert all(e["delta"]["type"] == "input_json_delta" for e in events if e["type"] == "content_block_delta")
        jsonschema.validate(json.loads("".join(json_deltas)), WEATHER_SCHEMA)
    else:
        msg = create(client, **kw)
    use = check_weather_call(msg)
    # The tool's result goes back as a tool_result block; "any" then forces one call of either tool.
    turns = [
        *USER,
        {"role": "assistant", "content": msg.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]},
    ]
    any_one = {"type": "any", "disable_parallel_tool_use": True}
    second = create(client, max_tokens=160, tools=TOOLS, tool_choice=any_one, messages=turns)
    uses = [b for b in second.content if b.type == "tool_use"]
    assert len(uses) == 1 and second.stop_reason == "tool_use"
    schema = next(t["input_schema"] for t in TOOLS if t["name"] == uses[0].name)
    jsonschema.validate(uses[0].input, schema)
    # tool_choice none: text, and the tool result is in the prompt (its length counts).
    third = create(client, max_tokens=4, tools=TOOLS, tool_choice={"type": "none"}, messages=turns)
    assert all(b.type == "text" for b in third.content) and third.stop_reason in ("max_tokens", "end_turn")
    longer = [*turns[:2], {"role": "user", "content": [{**turns[2]["content"][0], "content": "18 C, sunny" * 5}]}]
    n = client.messages.count_tokens(model=MODEL, messages=turns).input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=longer).input_tokens > n


def test_prefill_continues_the_assistant_message(client, tiny_llama):
    from transformers import AutoTokenizer

    turns = [*USER, {"role": "assistant", "content": "The weather is"}]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    text = tok.apply_chat_template(turns, tokenize=False, continue_final_message=True)
    assert text.endswith("The weather is")
    expected = len(tok.encode(text, add_special_tokens=False))
    assert client.messages.count_tokens(model=MODEL, messages=turns).input_tokens == expected
    msg = create(client, max_tokens=4, messages=turns)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == expected


def test_api_keys(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": USER}
    bearer = httpx.post(server.url("/v1/messages"), json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert bearer.status_code == 200
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=USER)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    # The OpenAI routes take x-api-key too, and keep their own error shape.
    assert httpx.get(server.url("/v1/models"), headers={"x-api-key": KEY}, timeout=10).status_code == 200
    openai_shape = httpx.get(server.url("/v1/models"), headers={"x-api-key": "wrong"}, timeout=10)
    assert openai_shape.status_code == 401 and openai_shape.json()["error"]["code"] == "invalid_api_key"


def anthropic_error(response: httpx.Response, status: int, kind: str = "invalid_request_error") -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


BAD_REQUESTS = [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 8, "messages": []}, "messages"),
    ({"max_tokens": 8, "messages": USER, "frequency_penalty": 1.0}, "frequency_penalty"),
    ({"max_tokens": 8, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, "document"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    ({"max_tokens": 8, "messages": USER, "tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"max_tokens": 8, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"max_tokens": 8, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"max_tokens": 8, "messages": USER, "stop_sequences": ["x"] * 65}, "stop_sequences"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens"),
    ({"max_tokens": 10**9, "messages": USER}, "max_tokens"),
    ({"max_tokens": 8, "messages": USER, "temperature": -1.0}, "temperature"),
    ({"max_tokens": 8, "messages": USER, "system": [{"type": "image"}]}, "system"),
]


@pytest.mark.parametrize(("body", "named"), BAD_REQUESTS)
def test_bad_input_is_a_400_in_anthropic_shape(server, body, named):
    headers = {"x-api-key": KEY}
    r = httpx.post(server.url("/v1/messages"), json={"model": MODEL, **body}, headers=headers, timeout=60)
    assert named in anthropic_error(r, 400)


def test_other_errors_in_anthropic_shape(server, client):
    headers = {"x-api-key": KEY}
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=8, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    json_headers = {**headers, "content-type": "application/json"}
    not_json = httpx.post(server.url("/v1/messages"), content=b"{", headers=json_headers, timeout=10)
    assert "JSON" in anthropic_error(not_json, 400)
    huge = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 300_000}]}
    too_large = httpx.post(server.url("/v1/messages/count_tokens"), json=huge, headers=headers, timeout=30)
    anthropic_error(too_large, 413, "request_too_large")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert e.value.body["type"] == "error"
    assert server.wait_idle()["num_requests_running"] == 0


def test_blocks_as_the_sdk_dumps_them_are_accepted(client):
    """Clients send the answer's blocks back as the SDK dumps them: null citations, caller..."""
    from anthropic.types import TextBlock, ToolUseBlock

    text = TextBlock(type="text", text="Let me check.")
    use = ToolUseBlock(type="tool_use", id="toolu_1", name="get_weather", input={"city": "Paris", "unit": "c"})
    assert text.model_dump()["citations"] is None  # what is being sent
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C", "cache_control": None}

    def turns(blocks: list[dict]) -> list[dict]:
        return [*USER, {"role": "assistant", "content": blocks}, {"role": "user", "content": [result]}]

    plain = [{"type": "text", "text": text.text}, {k: getattr(use, k) for k in ("type", "id", "name", "input")}]
    n = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=turns(plain)).input_tokens
    dumped = turns([text.model_dump(), use.model_dump()])
    assert client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=dumped).input_tokens == n
    msg = create(client, max_tokens=2, tools=TOOLS, messages=dumped)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == n
