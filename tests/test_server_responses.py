"""/v1/responses (OpenAI's Responses API) through the real `openai` client against `pagedllm serve`.

Every answer and every streamed event is also validated against the SDK's own pydantic types
(the SDK builds its objects without validating). The tiny model's weights are random: what must
hold of its outputs is checked against the chat endpoint answering the same messages (greedy), or
is the doing of a constraint (a named tool_choice, text.format json_schema).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_server import served

from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.responses_input import input_messages
from pagedllm.entrypoints.openai.responses_streaming import ResponseEvents, StreamedOutput
from pagedllm.entrypoints.openai.tool_calls import ToolPlan
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser, MistralToolParser, Qwen3XmlToolParser

MODEL = "tiny"
STORE_SIZE = 6
MAX_MESSAGES = 12
# Enough for any JSON the schemas below allow (a string's characters may be written as escapes)
MAX_JSON_TOKENS = 160
EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    with served(
        tiny_llama,
        tmp_path_factory,
        "--served-model-name",
        MODEL,
        "--num-kv-blocks",
        "1024",
        "--responses-store-size",
        str(STORE_SIZE),
        "--max-messages",
        str(MAX_MESSAGES),
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)


def create(client, **kw) -> Response:
    """client.responses.create, its raw JSON validated by the SDK's Response type."""
    raw = client.responses.with_raw_response.create(model=MODEL, **kw)
    Response.model_validate(raw.http_response.json())
    return raw.parse()


def stream(client, **kw) -> list:
    """The events of a streamed response, each validated from its raw JSON by the SDK's types."""
    with client.responses.with_streaming_response.create(model=MODEL, stream=True, **kw) as raw:
        lines = [line for line in raw.http_response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data]  # the SSE event name is the event's type
    events = [EVENTS.validate_python(d) for d in data]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # The SDK's stream helper checks that the events build the response they end with (a request
    # of its own: sampled, its events may differ from the ones above)
    with client.responses.stream(model=MODEL, **kw) as sdk_stream:
        sdk_events = list(sdk_stream)
        assert sdk_events[-1].type in ("response.completed", "response.incomplete")
        if sdk_events[-1].type == "response.completed":
            assert sdk_stream.get_final_response().output_text == sdk_events[-1].response.output_text
    return events


def chat(client, messages, max_tokens, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def test_plain_matches_chat(client):
    r = create(client, input="Name a color.", instructions="Be brief.", max_output_tokens=12, temperature=0)
    c = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}], 12)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")
    assert [item.type for item in r.output] == ["message"]
    # The same messages as items: developer is the system role, text parts join
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
    ]
    r2 = create(client, input=items, max_output_tokens=12, temperature=0)
    assert (r2.output_text, r2.usage.input_tokens) == (r.output_text, r.usage.input_tokens)


def test_cached_tokens_count_the_prefix_cache(client, server):
    long = "Tell me about the sea and the sky. " * 20
    create(client, input=long + "First.", max_output_tokens=2)
    r = create(client, input=long + "Second.", max_output_tokens=2)
    cached = r.usage.input_tokens_details.cached_tokens
    assert 0 < cached < r.usage.input_tokens


def test_streamed_events_in_order(client):
    kw = {"input": "Say something.", "max_output_tokens": 10, "temperature": 0}
    events = stream(client, **kw)
    types = [e.type for e in events]
    final = "response.incomplete" if types[-1] == "response.incomplete" else "response.completed"
    n_delta = types.count("response.output_text.delta")
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n_delta,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final,
    ]
    assert events[0].response.status == "in_progress"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text == events[types.index("response.output_text.done")].text == done.output_text
    assert done.output[0].id == events[2].item.id
    plain = create(client, **kw)
    assert (text, done.usage.output_tokens, done.status) == (plain.output_text, plain.usage.output_tokens, plain.status)


def function_calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def check_call(call, tool) -> None:
    assert call.name == tool["name"] and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])


def test_tool_loop_over_previous_response_id(client):
    """Several turns of call -> output, as an agent runs them: each turn continues the stored
    conversation, which the prompt must hold: it grows, and replaying the same items without
    previous_response_id renders the same prompt."""
    tools = [WEATHER, TIME]
    r = create(
        client,
        input="Weather in Paris, then the time?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (call,) = function_calls(r)
    check_call(call, WEATHER)
    replay = [{"role": "user", "content": "Weather in Paris, then the time?"}, *(i.model_dump() for i in r.output)]
    sizes = [r.usage.input_tokens]
    for turn, (tool, result) in enumerate([(TIME, "sunny, 21 c"), (WEATHER, "zone 1")]):
        output = {"type": "function_call_output", "call_id": call.call_id, "output": result}
        choice = {"type": "function", "name": tool["name"]}
        if turn == 1:  # one turn streamed: the arguments arrive as deltas, as they are generated
            events = stream(client, previous_response_id=r.id, input=[output], tools=tools, tool_choice=choice)
            deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            args_done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
            assert [deltas] == args_done
            r = events[-1].response
            assert args_done == [function_calls(r)[0].arguments]
            r = client.responses.retrieve(r.id)  # stored by the stream too
        else:
            r = create(client, previous_response_id=r.id, input=[output], tools=tools, tool_choice=choice)
        (call,) = function_calls(r)
        check_call(call, tool)
        replay += [output, *(i.model_dump() for i in r.output)]
        sizes.append(r.usage.input_tokens)
    final_output = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
    last = create(client, previous_response_id=r.id, input=[final_output], tools=tools, tool_choice="none")
    assert [i.type for i in last.output] == ["message"] and not function_calls(last)
    sizes.append(last.usage.input_tokens)
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes), sizes
    replayed = create(client, input=[*replay, final_output], tools=tools, tool_choice="none", max_output_tokens=1)
    assert replayed.usage.input_tokens == last.usage.input_tokens


@pytest.mark.parametrize("streamed", [False, True])
def test_required_tool_choice(client, streamed):
    # One call (parallel_tool_calls off): a list of calls could go on past any max_output_tokens
    kw = {"input": "Weather or time?", "tools": [WEATHER, TIME], "tool_choice": "required"}
    kw |= {"parallel_tool_calls": False, "max_output_tokens": MAX_JSON_TOKENS}
    r = stream(client, **kw)[-1].response if streamed else create(client, **kw)
    assert r.status == "completed" and [i.type for i in r.output] == ["function_call"]
    (call,) = function_calls(r)
    check_call(call, {"get_weather": WEATHER, "get_time": TIME}[call.name])


def test_instructions_are_not_carried_over(client):
    first = create(client, input="Hi.", instructions="You are a pirate. " * 10, max_output_tokens=2)
    second = create(client, input="Hi.", previous_response_id=first.id, max_output_tokens=2)
    again = create(
        client, input="Hi.", previous_response_id=first.id, instructions="You are a pirate. " * 10, max_output_tokens=2
    )
    assert second.usage.input_tokens < again.usage.input_tokens
    assert second.instructions is None and second.previous_response_id == first.id


@pytest.mark.parametrize("streamed", [False, True])
def test_json_schema_text_format(client, streamed):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}}
    kw = {"input": "A person as JSON.", "text": fmt, "max_output_tokens": MAX_JSON_TOKENS}
    r = stream(client, **kw)[-1].response if streamed else create(client, **kw)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    obj = create(client, input="Any JSON object.", text={"format": {"type": "json_object"}}, max_output_tokens=60)
    # A random model's free JSON may not end within the limit: then it is cut, never other text
    assert obj.output_text.startswith("{") and obj.text.format.type == "json_object"
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_store_retrieve_delete(client):
    kept = create(client, input="Remember me.", max_output_tokens=3)
    assert kept.store is True
    got = client.responses.retrieve(kept.id)
    assert got.model_dump() == kept.model_dump()
    unstored = create(client, input="Forget me.", max_output_tokens=3, store=False)
    for call in (
        lambda: client.responses.retrieve(unstored.id),
        lambda: create(client, input="And?", previous_response_id=unstored.id),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "invalid_request_error" and unstored.id in e.value.body["message"]
    # Continuing an unstored response: it may continue a stored one, and is itself not kept
    assert create(client, input="Go on.", previous_response_id=kept.id, store=False, max_output_tokens=2)
    client.responses.delete(kept.id)
    for call in (lambda: client.responses.retrieve(kept.id), lambda: client.responses.delete(kept.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_store_evicts_least_recently_used(client):
    ids = [create(client, input=f"Number {i}.", max_output_tokens=1).id for i in range(STORE_SIZE)]
    client.responses.retrieve(ids[0])  # now the most recently used
    create(client, input="One more.", max_output_tokens=1)
    client.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url("/v1/responses"), json=body, timeout=60)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": 5}, "input"),
        ({"model": MODEL, "input": "x", "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 1.5}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "store": "yes"}, "store"),
        ({"model": MODEL, "input": "x", "frobnicate": 1}, "frobnicate"),
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "input"),
        (
            {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"model": MODEL, "input": [{"type": "function_call", "name": "f"}]}, "input"),
        ({"model": MODEL, "input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"model": MODEL, "input": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}, "input"),
        ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        (
            {"model": MODEL, "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
        ),
        ({"model": MODEL, "input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"model": MODEL, "input": "x", "tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"model": MODEL, "input": "x", "text": {"format": {"type": "yaml"}}}, "text"),
        ({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text"),
        ({"model": MODEL, "input": "x", "background": True}, "background"),
        ({"model": MODEL, "input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"model": MODEL, "input": "x", "truncation": "auto"}, "truncation"),
        ({"model": MODEL, "input": "x", "include": ["message.output_text.logprobs"]}, "include"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"model": MODEL, "input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
        ({"model": MODEL, "input": "x" * 10**6}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_unknown_ids_are_404s(server):
    r = post(server, {"model": MODEL, "input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert r.json()["error"]["code"] == "previous_response_not_found"
    for method in (httpx.get, httpx.delete):
        r = method(server.url("/v1/responses/resp_nope"), timeout=10)
        assert r.status_code == 404 and "resp_nope" in r.json()["error"]["message"]
    assert post(server, {"model": "other", "input": "x"}).status_code == 404


def test_store_bounds_count_and_characters():
    store = ResponseStore(max_responses=3, max_chars=10**6)
    for i in range(4):
        store.put(f"r{i}", {"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert store.get("r0") is None and len(store) == 3
    big = [{"role": "user", "content": "y" * 600_000}]
    store.put("big1", {}, big)
    store.put("big2", {}, big)  # over the characters: everything older goes, the newest stays
    assert [k for k in ("r1", "r2", "r3", "big1", "big2") if store.get(k)] == ["big2"]
    assert store.delete("big2") and not store.delete("big2") and len(store) == 0
    none = ResponseStore(max_responses=0)
    none.put("r", {}, [])
    assert none.get("r") is None


def test_items_become_chat_messages():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    messages = input_messages(
        [
            {"role": "developer", "content": parts},
            {"role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
            call,
            {**call, "call_id": "c2"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
        ]
    )
    assert [m["role"] for m in messages] == ["system", "assistant", "tool"]
    assert messages[0]["content"] == "a\nb"
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"] and messages[1]["content"] == "calling"
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "1"}


def test_auto_tool_calls_stream_after_the_text():
    """tool_choice "auto" (a server with a tool parser): the text before the call streams as it
    grows, the call's marker is held back, and the call follows as its own item, its arguments
    in deltas as they are written."""
    plan = ToolPlan("auto", [], parser=HermesToolParser())
    events = ResponseEvents()
    output = StreamedOutput(events, plan)
    text = 'Checking. <tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>'
    sse = [e for n in range(1, len(text) + 1) for e in output.update(text[:n], n == len(text))]
    sse += output.finish("completed")
    parsed = [EVENTS.validate_python(json.loads(e.split("data: ", 1)[1])) for e in sse]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    deltas = "".join(e.delta for e in parsed if e.type == "response.output_text.delta")
    assert deltas == "Checking. " and "<" not in deltas
    assert [e.type for e in parsed if "output_item" in e.type] == [
        "response.output_item.added",
        "response.output_item.done",
        "response.output_item.added",
        "response.output_item.done",
    ]
    message, call = output.items
    assert message["type"] == "message" and message["content"][0]["text"] == deltas
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "get_time", {"zone": 1})
    arguments = [e for e in parsed if e.type.startswith("response.function_call_arguments")]
    assert {e.output_index for e in arguments} == {1} and arguments[-1].type.endswith(".done")
    assert "".join(e.delta for e in arguments[:-1]) == arguments[-1].arguments == call["arguments"]
    assert len(arguments) > 4  # not one delta at the end


@pytest.mark.parametrize(
    ("parser", "call"),
    [
        (HermesToolParser(), '<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>'),
        (MistralToolParser(), '[TOOL_CALLS]get_time[ARGS]{"zone": 1}'),
        (Qwen3XmlToolParser(), "<tool_call>\n<function=get_time>\n<parameter=zone>\n1\n</parameter>\n</function>"),
    ],
)
def test_text_before_a_call_in_the_last_output_is_sent(parser, call):
    """The engine may hand over the text before a call and the call together, finished: that
    text is still the message, before the call."""
    plan = ToolPlan("auto", [], parser=parser)
    output = StreamedOutput(ResponseEvents(), plan)
    text = "Checking the time. " + call
    sse = output.update("Check", False) + output.update(text, True) + output.finish("completed")
    parsed = [EVENTS.validate_python(json.loads(e.split("data: ", 1)[1])) for e in sse]
    deltas = "".join(e.delta for e in parsed if e.type == "response.output_text.delta")
    assert deltas == "Checking the time. "
    message, fn = output.items
    assert message["content"][0]["text"] == deltas and fn["name"] == "get_time"
