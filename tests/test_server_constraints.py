"""Output constraints and tool calls that must not cost `pagedllm serve` more than their caps, fail
silently, or end a response with a 500 or a cut stream (the tiny model, a real server on loopback).

- Oversized constraints are 400s naming the field they came in, before anything compiles; so is
  one that cannot compile.
- A constraint llguidance fails on mid-output ends its choice with finish_reason "stop" and
  stop_reason "structured_output_error": no text after it, one log line, no content in the log.
- Tool-call output that does not parse is content (plain and streamed), and a streamed response
  whose serving fails after its 200 ends with an error event and [DONE].

The costs measured against a concurrent request are test_server_constraint_costs.py's.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server import served
from test_server_faults import fault_env
from test_structured_limits import words

from pagedllm.structured_output.state import STOP_REASON
from pagedllm.tokenizer import load_tokenizer

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What time is it?"}]
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]},
    },
}
FAIL_TOP = 7  # fault_server: formatting 7 top logprobs raises


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    with served(
        tiny_llama,
        tmp_path_factory,
        "--served-model-name",
        MODEL,
        module="fault_server",
        env=fault_env(PAGEDLLM_TEST_FAIL_TOP_LOGPROBS=str(FAIL_TOP)),
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)


def chat(server, **body) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body}
    return httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)


BIG_SCHEMA = {"type": "object", "properties": {w: {"type": "string", "description": w * 8} for w in words(1200, 1)}}


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"guided_choice": words(1001, 0)}, "guided_choice", "1001 choices; at most 1000"),
        ({"structured_outputs": {"choice": ["x" * 70_000]}}, "structured_outputs", "choices together are 70000 bytes"),
        ({"guided_regex": "a" * 70_000}, "guided_regex", "the regex is 70000 bytes"),
        ({"guided_grammar": 'root ::= "' + "a" * 70_000 + '"'}, "guided_grammar", "the grammar is"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG_SCHEMA}}},
            "response_format",
            "the JSON schema is",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": BIG_SCHEMA}}],
                "tool_choice": "required",
            },
            "tools",
            "the JSON schema is",
        ),
        ({"guided_regex": "a("}, "guided_regex", "cannot be compiled"),
        ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "guided_json", "structured"),
    ],
)
def test_oversized_or_broken_constraints_are_400s_naming_the_field(server, body, param, needle):
    r = chat(server, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_a_failed_constraint_ends_the_choice_and_logs_one_line_without_content(client, server):
    """1,000 optional properties: after '{"' llguidance holds more parser items in a row than its
    limit. Every choice stops there (the old code went on unconstrained), and the request logs
    one line that quotes neither the schema nor the output."""
    names = words(1000, 7)
    schema = {"type": "object", "properties": {n: {"type": "string"} for n in names}}
    before = server.log_tail(10**7)
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=60,
        n=3,
        temperature=1.0,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "many", "schema": schema}},
    )
    for c in r.choices:
        assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == STOP_REASON, c
        assert c.message.content in ("", "{", '{"'), c.message.content
    assert server.wait_idle()["num_requests_running"] == 0
    log = server.log_tail(10**7)[len(before) :]
    assert log.count("structured output failed") == 1, log
    assert not any(n in log for n in names)


def digit_ids(model_dir: str) -> list[int]:
    vocab = load_tokenizer(model_dir).get_vocab()
    return sorted(i for t, i in vocab.items() if t.isdigit())


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_with_allowed_tokens_outside_its_grammar(client, server, tiny_llama, stream):
    """allowed_token_ids of digits only, where the calls' grammar starts with '[': the constraint
    fails at once (the old code went on unconstrained, wrote a number, and its parser raised a
    TypeError: a 500, or a cut stream). Now: no calls, the text as content, a clean finish."""
    kw = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=[TIME],
        tool_choice="required",
        max_tokens=16,
        extra_body={"allowed_token_ids": digit_ids(tiny_llama)},
    )
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop"]
        assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    else:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "stop" and c.message.tool_calls is None
        assert c.model_extra["stop_reason"] == STOP_REASON
    assert server.wait_idle()["num_requests_running"] == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_failing_after_its_200_ends_with_an_error_event_and_done(server, client, path):
    body = {"model": MODEL, "max_tokens": 5, "stream": True}
    if path == "/v1/chat/completions":
        body.update(messages=MESSAGES, logprobs=True, top_logprobs=FAIL_TOP)
    else:
        body.update(prompt="Hello", logprobs=FAIL_TOP)
    with httpx.stream("POST", server.url(path), json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] is None and error["type"] == "server_error" and "secret" not in events[-2]
    # The official client reads the event as an API error, not as a broken connection.
    with pytest.raises(openai.APIError) as e:
        if path == "/v1/chat/completions":
            list(
                client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, logprobs=True, top_logprobs=FAIL_TOP
                )
            )
        else:
            list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stream=True, logprobs=FAIL_TOP))
    assert not isinstance(e.value, openai.APIConnectionError)
    assert server.wait_idle()["num_requests_running"] == 0
