"""`pagedllm serve --reasoning-parser deepseek_r1` with a chat template that opens the think tag
in the prompt (as DeepSeek-R1's does): chat's reasoning_content, /v1/responses' reasoning items
and /v1/messages' thinking blocks, plain and streamed, parsed by the official SDKs.

Each runs on the tiny model and on the default model (smollm2-135m-instruct, which closes the
think tag and answers after two examples of the format). The greedy outputs are not fixed
text: each answer is checked against the parser's rule applied to the same output read raw from
/v1/completions (the chat prompt's tokens as prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_server import ServerProcess
from test_server_messages import check_event_order, raw_events
from tiny_models import CHATML_TEMPLATE

from pagedllm.entrypoints.openai.reasoning_parsers import reasoning_parser

MODEL = "tiny"
MAX_TOKENS = 24
# A ChatML template whose generation prompt opens the think section
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Is 7 prime? Think first."}]
PARSER = reasoning_parser("deepseek_r1")
RESPONSE_EVENTS = TypeAdapter(ResponseStreamEvent)
GREEDY = {"temperature": 0}


def start_server(
    model_dir: str, log_dir, *extra: str, template: str = THINKING_TEMPLATE, parser: str = "deepseek_r1"
) -> ServerProcess:
    return ServerProcess(
        model_dir,
        str(log_dir / "server.log"),
        "--served-model-name",
        MODEL,
        "--chat-template",
        template,
        "--reasoning-parser",
        parser,
        *extra,
    )


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = start_server(tiny_llama, tmp_path_factory.mktemp("server"), "--num-kv-blocks", "1024")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    srv = start_server("smollm2-135m-instruct", tmp_path_factory.mktemp("default"))
    yield srv
    srv.stop()


# The default model, shown two answers in the think format, reasons, closes the tag and answers
# (the tiny model's random text never closes it: all of it is reasoning).
SHOTS = []
for _country, _city in (("Italy", "Rome"), ("Spain", "Madrid")):
    SHOTS.append({"role": "user", "content": f"What is the capital of {_country}?"})
    SHOTS.append({"role": "assistant", "content": f"<think>\n{_country}'s capital city is {_city}.\n</think>\n{_city}"})
DEFAULT_MESSAGES = [*SHOTS, {"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Served:
    server: ServerProcess
    messages: list[dict]
    max_tokens: int


@pytest.fixture(scope="module", params=["tiny", "default"])
def served(request) -> Served:
    if request.param == "tiny":
        return Served(request.getfixturevalue("server"), MESSAGES, MAX_TOKENS)
    return Served(request.getfixturevalue("default_server"), DEFAULT_MESSAGES, 64)


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=300)


def expected_split(server, messages=MESSAGES, max_tokens=MAX_TOKENS, parser=PARSER) -> tuple[str, str]:
    """What the parser makes of the raw output of the chat prompt: (reasoning, content)."""
    tokens = httpx.post(server.url("/tokenize"), json={"model": MODEL, "messages": messages}, timeout=60).json()
    raw = client_of(server).completions.create(model=MODEL, prompt=tokens["tokens"], max_tokens=max_tokens, **GREEDY)
    split = parser.split(raw.choices[0].text)
    return split.reasoning or "", split.content


def check_chat(server, messages=MESSAGES, max_tokens=MAX_TOKENS, parser=PARSER) -> tuple[str, str]:
    client = client_of(server)
    expected = expected_split(server, messages, max_tokens, parser)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY)
    message = plain.choices[0].message
    assert ((message.reasoning_content or ""), message.content or "") == expected  # type: ignore[attr-defined]
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, stream=True, **GREEDY)
    )
    kinds, reasoning, content = [], "", ""
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta.model_extra.get("reasoning_content")
            if delta:
                reasoning += delta
                kinds.append("reasoning")
            if choice.delta.content:
                content += choice.delta.content
                kinds.append("content")
    assert (reasoning, content) == expected
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # all reasoning deltas come first
    return expected


def test_chat_reasoning_content_plain_and_streamed(served):
    reasoning, content = check_chat(served.server, served.messages, served.max_tokens)
    assert reasoning.strip()  # the template opened the think section: the output starts as reasoning
    if served.messages is DEFAULT_MESSAGES:
        assert "Paris" in content


def expected_reasoning_tokens(server, messages, max_tokens) -> int:
    """The raw output's tokens up to and including the one that completes the end of think tag."""
    tokens = httpx.post(server.url("/tokenize"), json={"model": MODEL, "messages": messages}, timeout=60).json()
    kw = {"model": MODEL, "prompt": tokens["tokens"], "max_tokens": max_tokens, "logprobs": 0, **GREEDY}
    pieces = client_of(server).completions.create(**kw).choices[0].logprobs.tokens
    for i in range(len(pieces)):
        if "</think>" in "".join(pieces[: i + 1]):
            return i + 1
    return len(pieces)  # still thinking when cut off: all of it


def test_reasoning_tokens_are_counted(served):
    client = client_of(served.server)
    expected = expected_reasoning_tokens(served.server, served.messages, served.max_tokens)
    kw = {"model": MODEL, "messages": served.messages, "max_tokens": served.max_tokens, **GREEDY}
    plain = client.chat.completions.create(**kw)
    assert plain.usage.completion_tokens_details.reasoning_tokens == expected
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == expected
    rkw = {"model": MODEL, "input": served.messages, "max_output_tokens": served.max_tokens, **GREEDY}
    response = client.responses.create(**rkw)
    assert response.usage.output_tokens_details.reasoning_tokens == expected
    with client.responses.stream(**rkw) as stream:  # completed, or incomplete when cut off
        final = list(stream)[-1].response
    assert final.usage.output_tokens_details.reasoning_tokens == expected
    if served.messages is DEFAULT_MESSAGES:  # closed the tag, then answered
        assert 0 < expected < response.usage.output_tokens
    else:  # the tiny model never closes it
        assert expected == response.usage.output_tokens


def test_responses_reasoning_item(served):
    server = served.server
    client = client_of(server)
    expected = expected_split(server, served.messages, served.max_tokens)
    kw = {"model": MODEL, "input": served.messages, "max_output_tokens": served.max_tokens, **GREEDY}
    kw["reasoning"] = {"effort": "low", "summary": "auto"}  # accepted with a reasoning parser
    raw = client.responses.with_raw_response.create(**kw)
    Response.model_validate(raw.http_response.json())
    response = raw.parse()
    kinds = [item.type for item in response.output]
    assert kinds[0] == "reasoning" and kinds[1:] == ["message"]
    reasoning_text = "".join(part.text for part in response.output[0].content)
    assert (reasoning_text, response.output_text) == expected
    assert response.reasoning.effort == "low"

    with client.responses.with_streaming_response.create(stream=True, **kw) as streamed:
        data = [json.loads(line[6:]) for line in streamed.http_response.iter_lines() if line.startswith("data: ")]
    events = [RESPONSE_EVENTS.validate_python(d) for d in data]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == expected[0] and done == [expected[0]]
    final = events[-1].response
    assert [item.type for item in final.output] == kinds
    assert final.output[0].content[0].text == expected[0] and final.output_text == expected[1]
    with client.responses.stream(**kw) as sdk_stream:  # the SDK's own reading of the events
        sdk_events = list(sdk_stream)
    assert sdk_events[-1].response.output[0].content[0].text == expected[0]

    # The output items sent back as input, reasoning item included (as the Agents SDK does)
    sent_back = [item.model_dump(exclude_none=True) for item in response.output]
    next_input = [*served.messages, *sent_back, {"role": "user", "content": "And Germany?"}]
    again = client.responses.create(**{**kw, "input": next_input})
    assert again.output[0].type == "reasoning"


def test_responses_forced_tool_after_the_reasoning(server):
    """A named tool_choice streams its call after the reasoning item, which opens once."""
    tool = {"type": "function", "name": "answer", "parameters": {"type": "object", "properties": {}}}
    kw = {"model": MODEL, "input": MESSAGES, "max_output_tokens": MAX_TOKENS, "tools": [tool], **GREEDY}
    kw["tool_choice"] = {"type": "function", "name": "answer"}
    with client_of(server).responses.with_streaming_response.create(stream=True, **kw) as streamed:
        data = [json.loads(line[6:]) for line in streamed.http_response.iter_lines() if line.startswith("data: ")]
    events = [RESPONSE_EVENTS.validate_python(d) for d in data]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added[0] == "reasoning" and added.count("reasoning") == 1
    final = events[-1].response
    assert [item.type for item in final.output] == added


def test_responses_reasoning_field_keeps_its_checks(server):
    r = httpx.post(
        server.url("/v1/responses"), json={"model": MODEL, "input": "hi", "reasoning": {"budget": 3}}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning"


def test_messages_thinking_block(served):
    server = served.server
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
    expected = expected_split(server, served.messages, served.max_tokens)
    kw = {
        "model": MODEL,
        "max_tokens": served.max_tokens,
        "messages": served.messages,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": GREEDY,
    }
    raw = client.messages.with_raw_response.create(**kw)
    Message.model_validate(raw.http_response.json())
    message = raw.parse()
    assert message.content[0].type == "thinking" and message.content[0].thinking == expected[0]
    assert isinstance(message.content[0].signature, str)
    assert "".join(b.text for b in message.content if b.type == "text") == expected[1]

    events = raw_events(server, **{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY)
    check_event_order(events)
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    kinds = [d["type"] for d in deltas]
    assert kinds[0] == "thinking_delta" and kinds.index("signature_delta") == kinds.count("thinking_delta")
    assert "".join(d.get("thinking", "") for d in deltas) == expected[0]
    assert "".join(d.get("text", "") for d in deltas) == expected[1]
    with client.messages.stream(**kw) as stream:  # the SDK's own reading of the events
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == expected[0]

    # A thinking block sent back in the history is accepted (and left out of the prompt)
    history = [*served.messages, {"role": "assistant", "content": message.model_dump(exclude_none=True)["content"]}]
    history.append({"role": "user", "content": "And 9?"})
    again = client.messages.create(**{**kw, "messages": history})
    assert again.content and again.content[0].type in ("thinking", "text")


def test_structured_output_constrains_the_answer_only(server):
    """With a reasoning parser the output may think first: the JSON constraint starts after it."""
    client = client_of(server)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, response_format=response_format, **GREEDY
    )
    message = out.choices[0].message
    if message.content:  # the reasoning ended within the budget: what follows is the JSON
        assert json.loads(message.content)["ok"] in (True, False)
    else:
        assert message.reasoning_content and out.choices[0].finish_reason == "length"  # type: ignore[attr-defined]


def test_qwen3_default_model_writes_its_own_think_tags(tmp_path_factory):
    """qwen3: a plain ChatML template (nothing opened in the prompt); the default model, shown
    the format, opens and closes the think section itself."""
    log_dir = tmp_path_factory.mktemp("qwen3")
    srv = start_server("smollm2-135m-instruct", log_dir, template=CHATML_TEMPLATE, parser="qwen3")
    try:
        reasoning, content = check_chat(srv, DEFAULT_MESSAGES, 64, reasoning_parser("qwen3"))
        assert reasoning.strip() and "Paris" in content
    finally:
        srv.stop()
