"""The Messages <-> chat translation (anthropic_convert.py) on its own: request blocks to chat
messages, tool_choice to the chat's, finished outputs to content blocks and stop_reason."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.anthropic_convert import finished_turn, messages_usage, to_chat_request
from pagedllm.entrypoints.openai.anthropic_errors import anthropic_error_body
from pagedllm.entrypoints.openai.anthropic_protocol import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.tool_calls import plan_tools
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}]


def request(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **kw})


def test_blocks_become_chat_messages():
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                {"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    t = to_chat_request(request(system=[{"type": "text", "text": "sys"}], messages=turns, tools=TOOLS))
    got = [m.model_dump(exclude_none=True) for m in t.request.messages]
    assert got == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "thanks"},
    ]
    assert t.request.tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, "description": "Weather"}}
    ]
    assert not t.continue_final_message


@pytest.mark.parametrize(
    ("choice", "chat_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any"}, "required", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, True),
        ({"type": "none"}, "none", True),
    ],
)
def test_tool_choice(choice, chat_choice, parallel):
    t = to_chat_request(request(messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice=choice))
    assert t.request.tool_choice == chat_choice
    assert t.parallel_tool_calls is parallel and t.request.parallel_tool_calls is parallel


def test_sampling_fields_and_prefill():
    t = to_chat_request(
        request(
            messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}],
            stop_sequences=["\n\n"],
            temperature=0.5,
            top_p=0.9,
            top_k=40,
        )
    )
    r = t.request
    assert (r.max_tokens, r.stop, r.temperature, r.top_p, r.top_k) == (8, ["\n\n"], 0.5, 0.9, 40)
    assert t.continue_final_message


def test_count_tokens_needs_no_tool_parser():
    req = CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": {"type": "auto"}}
    )
    t = to_chat_request(req)
    assert t.request.tool_choice == "none" and t.request.tools  # the tools still reach the template


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
        ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}]}, "reasoning"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use"}]}]}, "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": [{"type": ["text"]}]}]}, "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "adaptive"}}, "thinking"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "x", "type": "bash_20250124"}]},
            "tools.0",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "auto", "name": "x"}}, "tool_choice"),
    ],
)
def test_unsupported_input_is_a_400_naming_it(kw, named):
    with pytest.raises(APIError) as e:
        to_chat_request(request(**kw))
    assert e.value.status_code == 400
    assert named in anthropic_error_body(e.value)["error"]["message"]


USER = [{"role": "user", "content": "x"}]


def test_thinking_with_a_reasoning_parser():
    thinking = {"type": "thinking", "thinking": "hm", "signature": ""}
    history = [*USER, {"role": "assistant", "content": [thinking, {"type": "text", "text": "y"}]}, *USER]
    t = to_chat_request(request(messages=history, thinking={"type": "enabled", "budget_tokens": 1024}), True)
    assert [m.content for m in t.request.messages] == ["x", "y", "x"]  # the thinking is left out
    for bad in ({"type": "enabled"}, {"type": "enabled", "budget_tokens": "9"}, {"type": "adaptive"}):
        with pytest.raises(APIError) as e:
            to_chat_request(request(messages=USER, thinking=bad), True)
        assert e.value.param == "thinking"
    with pytest.raises(APIError):  # a user's thinking block is still refused
        to_chat_request(request(messages=[{"role": "user", "content": [thinking]}]), True)
    assert finished_turn(None, "y", "stop", None, True).content() == [{"type": "text", "text": "y"}]


def test_a_tool_input_too_deep_for_the_chat_request_is_a_400():
    deep: dict = {}
    for _ in range(26):  # within the Messages request's depth cap, beyond the chat request's
        deep = {"a": deep}
    use = {"type": "tool_use", "id": "t", "name": "f", "input": deep}
    req = request(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [use]}])
    with pytest.raises(APIError) as e:
        to_chat_request(req)
    assert e.value.status_code == 400 and "nested deeper" in e.value.message


def test_finished_turn_stop_reasons():
    assert finished_turn(None, "hi", "stop", 2, True).stop_reason == "end_turn"
    stopped = finished_turn(None, "hi", "stop", "END", True)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "END")
    assert finished_turn(None, "hi", "length", None, True).stop_reason == "max_tokens"
    assert finished_turn(None, "", "stop", 2, True).content() == []


def test_finished_turn_tool_uses():
    named = plan_tools([{"type": "function", "function": {"name": "f"}}], {"function": {"name": "f"}}, None, False)
    turn = finished_turn(named, '{"city": "Paris"}', "stop", 2, True)
    assert turn.stop_reason == "tool_use" and turn.text is None
    (use,) = turn.content()
    assert use["type"] == "tool_use" and use["name"] == "f" and use["input"] == {"city": "Paris"}
    cut = finished_turn(named, '{"city": "Pa', "length", None, True)  # cut arguments stay text
    assert cut.stop_reason == "max_tokens" and cut.content() == [{"type": "text", "text": '{"city": "Pa'}]
    auto = plan_tools([{"type": "function", "function": {"name": "f"}}], "auto", HermesToolParser(), True)
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    text = "Let me look." + call + call
    both = finished_turn(auto, text, "stop", 2, True)
    assert both.text == "Let me look." and [u["input"] for u in both.tool_uses] == [{"a": 1}, {"a": 1}]
    assert len({u["id"] for u in both.tool_uses}) == 2
    assert len(finished_turn(auto, text, "stop", 2, False).tool_uses) == 1  # disable_parallel_tool_use
    assert json.loads(json.dumps(both.content()))  # JSON-ready


def test_usage_splits_cached_tokens_out_of_input_tokens():
    assert messages_usage(100, 64, 7) == {
        "input_tokens": 36,
        "output_tokens": 7,
        "cache_read_input_tokens": 64,
        "cache_creation_input_tokens": 0,
    }
