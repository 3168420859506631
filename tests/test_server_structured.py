"""Structured outputs and tool calls through the real `openai` client against `pagedllm serve`.

The tiny model's weights are random, so every valid output below is the constraint's doing (its
unconstrained text is not JSON: tests/test_structured_outputs.py). Schemas bound their strings,
numbers and arrays so valid outputs end within max_tokens.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import openai
import pytest
from test_server import ServerProcess, served
from test_structured_outputs import random_schema

from pagedllm.entrypoints.openai.tool_calls import plan_tools, template_messages
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser
from pagedllm.models.resolve import default_model_gguf_path

MODEL = "tiny"
MAX_TOKENS = 160
SCHEMAS = [random_schema(random.Random(100 + i)) for i in range(20)]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    with served(
        tiny_llama,
        tmp_path_factory,
        "--served-model-name",
        MODEL,
        "--num-kv-blocks",
        "1024",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)


def chat_stream_text(client, **kw) -> tuple[str, list[dict], str]:
    """(content, tool calls accumulated as OpenAI's clients do, finish_reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = tc.id or c["id"]
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_strict(client, stream):
    for i, schema in enumerate(SCHEMAS):
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        kw = dict(messages=MESSAGES, response_format=rf, max_tokens=MAX_TOKENS, temperature=1.0, seed=i)
        if stream:
            text, _, finish = chat_stream_text(client, **kw)
        else:
            r = client.chat.completions.create(model=MODEL, **kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_completions_json_object_regex_choice_and_guided_fields(client):
    r = client.completions.create(
        model=MODEL,
        prompt="data:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}},
    )
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", r.choices[0].text)
    for seed in range(3):
        r = client.completions.create(
            model=MODEL,
            prompt="pick:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_choice": ["alpha", "beta", "gamma"]},
        )
        assert r.choices[0].text in ("alpha", "beta", "gamma")
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"guided_json": SCHEMAS[3]},
        )
    )
    jsonschema.validate(json.loads(text), SCHEMAS[3])
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"guided_grammar": 'root ::= "<" [a-c]+ ">"'},
    )
    assert re.fullmatch("<[a-c]+>", r.choices[0].message.content) or len(r.choices[0].message.content) > 150


def test_bad_constraints_are_400s(client, server):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"extra_body": {"guided_regex": "a("}}, None),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
        ({"extra_body": {"guided_whitespace_pattern": " "}}, "guided_whitespace_pattern"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, **kw)
        if param is not None:
            assert e.value.body["param"] == param, e.value.body
    assert server.wait_idle()["num_requests_running"] == 0


def check_calls(calls: list[dict], tools=TOOLS) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for c in calls:
        assert c["id"]
        jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])


def as_dicts(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(4):
        for choice in ("required", named):
            # One call at most: a random model left free may append calls until max_tokens.
            kw = dict(messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=MAX_TOKENS, seed=seed)
            kw["parallel_tool_calls"] = False
            if stream:
                content, calls, finish = chat_stream_text(client, temperature=1.0, **kw)
            else:
                r = client.chat.completions.create(model=MODEL, temperature=1.0, **kw)
                calls, finish = as_dicts(r.choices[0].message), r.choices[0].finish_reason
                content = r.choices[0].message.content
            assert finish == "tool_calls", (calls, content)
            assert not content
            check_calls(calls)
            if choice is named:
                assert [c["name"] for c in calls] == ["get_time"]


def test_tool_messages_reach_the_template_and_bad_tools_are_400s(client):
    history = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None
    for kw, param in [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kw)
        assert e.value.body["param"] == param


def test_auto_without_the_flag_is_a_400(tiny_llama, tmp_path):
    srv = ServerProcess(tiny_llama, str(tmp_path / "server.log"), "--served-model-name", MODEL)
    try:
        c = openai.OpenAI(base_url=srv.url("/v1"), api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4)
    finally:
        srv.stop()


def test_auto_returns_text_or_well_formed_calls(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=24, temperature=1.0, seed=seed
        )
        m = r.choices[0].message
        if m.tool_calls:
            check_calls(as_dicts(m))
            assert r.choices[0].finish_reason == "tool_calls"
        else:
            assert isinstance(m.content, str) and r.choices[0].finish_reason in ("stop", "length")


def test_hermes_parser():
    p = HermesToolParser()
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    )
    content, calls = p.extract(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"})]
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}'
    content, calls = p.extract(two)  # the second block unterminated (max_tokens): still a call
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {}), ("b", {"x": 1})]
    assert p.extract("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert p.extract("plain") == ("plain", [])
    # Streaming: text that may grow into "<tool_call>" is held back.
    assert p.streamable_len("Hi <tool") == 3
    assert p.streamable_len("Hi <tool_call>{") == 3
    assert p.streamable_len("Hi there") == 8


def test_llama3_json_parser():
    p = Llama3JsonToolParser()
    text = '<|python_tag|>{"name": "get_time", "parameters": {"zone": 2}}; {"name": "get_time", "parameters": {}}'
    content, calls = p.extract(text)
    assert content is None and [json.loads(c.arguments) for c in calls] == [{"zone": 2}, {}]
    assert p.extract("Sunny.") == ("Sunny.", [])
    assert p.extract('{"name": 3}') == ('{"name": 3}', [])
    assert p.streamable_len("  {") == 0 and p.streamable_len("<|pyth") == 0 and p.streamable_len("Sunny") == 5


def test_text_that_does_not_parse_as_calls_is_content():
    """Never a raise: a "required" output that is not a list of calls (a constraint that ended
    early, max_tokens, JSON nested past Python's recursion limit) and parsers' deep nesting."""
    required = plan_tools(TOOLS, "required", None, False)
    deep = "[" * 5000 + "]" * 5000
    for text in [
        "",
        "5",
        '"x"',
        "{}",
        "[]",
        "[1]",
        deep,
        "[" * 5000,
        '[{"name": 3, "parameters": {}}]',
        '[{"name": "get_time"}]',
        '[{"name": "get_time", "parameters": 5}]',
        '[{"name": "get_time", "parameters": {"zone": ' + deep + "}}]",
    ]:
        assert required.calls_of(text) == (text, []), text
    assert required.calls_of('[{"name": "get_time", "parameters": {"zone": 1}}]')[1][0].arguments == '{"zone": 1}'
    hermes, llama = HermesToolParser(), Llama3JsonToolParser()
    for text in ["<tool_call>" + deep, '<tool_call>{"name": "a", "arguments": "' + deep + '"}</tool_call>']:
        assert hermes.extract(text) == (text, [])
    text = '{"name": "a", "parameters": ' + deep + "}"
    assert llama.extract(text) == (text, [])
    history = [{"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": deep}}]}]
    assert template_messages(history)[0]["tool_calls"][0]["function"]["arguments"] == deep  # kept as sent


@pytest.mark.skipif(default_model_gguf_path() is None, reason="the default model is not installed")
def test_auto_with_the_default_model(tmp_path):
    """The model users run by default, asked a question its tools answer: the reply is text or
    tool calls that parse and match the tools' schemas (which it is, is the model's choice)."""
    srv = ServerProcess(
        "smollm2-135m-instruct",
        str(tmp_path / "server.log"),
        "--served-model-name",
        MODEL,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--num-kv-blocks",
        "64",
    )
    try:
        c = openai.OpenAI(base_url=srv.url("/v1"), api_key="none", max_retries=0, timeout=120)
        for stream in (False, True):
            kw = dict(messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=48, temperature=0)
            if stream:
                content, calls, finish = chat_stream_text(c, **kw)
            else:
                r = c.chat.completions.create(model=MODEL, **kw)
                m, finish = r.choices[0].message, r.choices[0].finish_reason
                content, calls = m.content, as_dicts(m) if m.tool_calls else []
            if calls:
                check_calls(calls)
                assert finish == "tool_calls"
            else:
                assert content and finish in ("stop", "length")
    finally:
        srv.stop()
