"""Streamed tool calls (tool_streaming.py): for every way a model's text can be cut into chunks, a
client that adds up the deltas gets the content and calls of the whole text, with the arguments
text exactly the non-streamed ``function.arguments``; JSON arguments (hermes, llama3_json,
mistral, tool_choice "required") arrive as they are written, not at the end.

And the JSON re-writer under it (json_stream.py): any prefix's output is a prefix of what json
re-serializes, whatever the chunking."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tool_parsers import EXAMPLES, MALFORMED, TOOLS, every_chunking

from pagedllm.entrypoints.openai.tool_calls import ToolPlan
from pagedllm.entrypoints.openai.tool_parsers import arguments_json, tool_parser
from pagedllm.entrypoints.openai.tool_parsers.json_stream import JsonRewriter
from pagedllm.entrypoints.openai.tool_streaming import ToolCallStream

JSON_EXAMPLES = [  # formats whose arguments stream as written
    ("hermes", 'Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
    (
        "hermes",
        '<tool_call>{"name":"search","arguments":{"query":"Zürich \\"東京\\" \\ud83d\\ude00\\n",'
        '"filters":{"x":[1E2,-0,0.5,true,null]},"tags":[]}}</tool_call>\n<tool_call>{"name": "get_current_weather", '
        '"arguments": {"city": "Paris"}}</tool_call>',
    ),
    ("llama3_json", '{"name": "add", "parameters": {"a": 3.5, "b": 4}}'),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "arguments": {"b": 2}}'),
    *[(name, text) for name, text, _, _ in EXAMPLES if name == "mistral"],
]
ALL_EXAMPLES = JSON_EXAMPLES + [(name, text) for name, text, _, _ in EXAMPLES if name != "mistral"]


def streamed(plan: ToolPlan, text: str, cuts) -> tuple[str, list[dict], ToolCallStream]:
    """(content, calls as a client adds them up, the stream) of ``text`` cut at ``cuts``."""
    stream, content, calls = ToolCallStream(plan), "", []
    for cut in [c for c in sorted(set(cuts)) if 0 < c < len(text)] + [len(text)]:
        step = stream.update(text[:cut], cut == len(text))
        content += step.content
        for d in step.calls:
            if d.name is not None:  # a call's first delta: index, id, name, no arguments yet
                assert d.index == len(calls) and d.arguments == "" and d.id
                calls.append({"id": d.id, "name": d.name, "arguments": "", "deltas": 0, "early": ""})
            else:
                calls[d.index]["arguments"] += d.arguments
                calls[d.index]["deltas"] += 1
        if cut < len(text):
            for c in calls:
                c["early"] = c["arguments"]
    return content, calls, stream


def check(plan: ToolPlan, text: str, cuts_list) -> None:
    content, final = plan.calls_of(text)
    for cuts in cuts_list:
        got_content, got_calls, stream = streamed(plan, text, cuts)
        assert [(c["name"], c["arguments"]) for c in got_calls] == [(c.name, c.arguments) for c in final], cuts
        assert [c["id"] for c in got_calls] == [c.id for c in stream.calls], cuts
        assert len({c["id"] for c in got_calls}) == len(got_calls)
        assert stream.has_calls == bool(final) and not stream.diverged
        if final:
            assert got_content.strip() == (content or ""), cuts
        else:
            assert got_content == text, cuts


def auto(name: str) -> ToolPlan:
    return ToolPlan("auto", TOOLS, parser=tool_parser(name))


@pytest.mark.parametrize(("name", "text"), ALL_EXAMPLES)
def test_every_chunking_adds_up_to_the_calls(name, text):
    assert auto(name).calls_of(text)[1]
    check(auto(name), text, every_chunking(text))


@pytest.mark.parametrize(("name", "text"), JSON_EXAMPLES)
def test_json_arguments_stream_as_written(name, text):
    _, calls, _ = streamed(auto(name), text, range(len(text)))
    for c in calls[:-1]:  # all sent before the text ended, in many deltas
        assert c["early"] == c["arguments"] and c["deltas"] > 2
    last = calls[-1]  # all but what the last characters can still change
    assert len(last["early"]) >= len(last["arguments"]) - 4 and last["deltas"] > 2


def test_qwen3_xml_arguments_stream_a_parameter_at_a_time():
    text = ALL_EXAMPLES[-2][1]  # two calls, two parameters each
    plan = auto("qwen3_xml")
    first_param = text.index("</parameter>") + len("</parameter>")
    _, calls, _ = streamed(plan, text, [text.index("<parameter=city>"), first_param])
    assert calls[0]["early"] == '{"city": "São Paulo"'  # the closed parameter, nothing of the next
    _, calls, _ = streamed(plan, text, range(len(text)))
    assert [c["deltas"] for c in calls] == [3, 3]  # each parameter as it closes, then the brace
    assert calls[0]["early"] == calls[0]["arguments"] == '{"city": "São Paulo", "unit": "c"}'


def test_qwen3_xml_repeated_parameter_keeps_what_streamed():
    param = "<parameter=a>\n{}\n</parameter>\n"
    text = f"<tool_call>\n<function=add>\n{param.format(1)}{param.format(2)}</function>\n</tool_call>"
    assert auto("qwen3_xml").calls_of(text)[1][0].arguments == '{"a": 1}'
    check(auto("qwen3_xml"), text, every_chunking(text))


def test_pythonic_arguments_stream_a_keyword_at_a_time():
    text = "[get_weather(city='San Francisco', metric='celsius'), get_time(zone={'tz': 'PST, UTC-8'}, n=2)]"
    _, calls, _ = streamed(auto("pythonic"), text, range(len(text)))
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert [c["deltas"] for c in calls] == [2, 2]  # each keyword as its value ends
    assert calls[1]["early"] == calls[1]["arguments"] == '{"zone": {"tz": "PST, UTC-8"}, "n": 2}'
    cut = text.index(", metric")
    _, calls, _ = streamed(auto("pythonic"), text, [cut + 1])
    assert calls[0]["early"] == '{"city": "San Francisco"'


@pytest.mark.parametrize(
    "text",
    [
        "[f(a='x), g(b=1)')]",
        '[f(a="""x),\ng(""", b=(1,\n2))]',
        "[f(a=1, a=2)]",
        "[f(1, a=2)]",
        "[f(a=1)] and more",
        "[f(a=open('x'))]",
    ],
)
def test_pythonic_strings_and_bad_calls_stream_as_the_finished_text_says(text):
    """A string holding call-like text opens no call; text that is not calls ends as content."""
    plan = auto("pythonic")
    if plan.calls_of(text)[1]:
        check(plan, text, every_chunking(text))
    else:
        content, _, stream = streamed(plan, text, range(len(text)))
        assert content == text and not stream.has_calls


@pytest.mark.parametrize(("name", "text"), [(n, t) for n, texts in MALFORMED.items() for t in texts])
def test_malformed_output_ends_as_text(name, text):
    for cuts in [list(range(0, len(text), 7)), []]:
        content, _, stream = streamed(auto(name), text, cuts)
        assert content == text and not stream.has_calls


def test_cut_short_call_is_kept_as_sent_and_the_rest_is_content():
    text = 'Hi <tool_call>{"name": "add", "arguments": {"a": 1, "b'
    content, calls, stream = streamed(auto("hermes"), text, range(len(text)))
    assert stream.diverged and not stream.has_calls and content == text
    assert calls[0]["name"] == "add" and calls[0]["arguments"] == '{"a": 1, "b'


def test_named_and_required_tool_choice():
    named = ToolPlan("named", TOOLS, named="add")
    check(named, ' {"a": 1,  "b": 2}', every_chunking(' {"a": 1,  "b": 2}'))
    required = ToolPlan("required", TOOLS)
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "search", "parameters": {"query": "x"}}]'
    check(required, text, every_chunking(text))
    _, calls, _ = streamed(required, text, range(len(text)))
    assert calls[0]["early"] == calls[0]["arguments"] and calls[0]["deltas"] > 2


def rewritten(raw: str, cuts) -> tuple[str, JsonRewriter]:
    r, out = JsonRewriter(), ""
    for cut in [*sorted(cuts), len(raw)]:
        out += r.feed(raw[:cut])
    return out, r


@pytest.mark.parametrize(
    "raw",
    [
        '{"a": 1, "b": [1, 2.50, -0, 1E2, true, null, false], '
        '"c": {"d": "x\\ny\\u00e9\\ud83d\\ude00 \\"q\\" \\/ é\\ud83d"}}',
        '{ "city" :"Zürich" ,"n":{}, "m":[ ] , "z": [[],{}] , "w": 1e-7, "big": 12345678901234567890}',
        '{"ctl": "\\u0001\\t", "lone": "\\udc00\\ud800x"}',
    ],
)
def test_rewriter_matches_json_in_every_chunking(raw):
    final = arguments_json(json.loads(raw))
    for cuts in every_chunking(raw):
        out, r = rewritten(raw, cuts)
        assert out == final and r.done and r.pos == len(raw), cuts


@pytest.mark.parametrize(
    "raw", ['{"a": NaN}', '{"a": 01}', '{"a": 1e999}', '{"a": 1, "a": 2}', '{"a": tru}', '{"a" 1}', '{"a": "x\ny"}']
)
def test_rewriter_stops_where_json_would_refuse(raw):
    out, r = rewritten(raw, range(len(raw)))
    assert r.stopped and not r.done and raw.startswith(out[:2])


@settings(max_examples=60, deadline=None)
@given(
    value=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
        max_leaves=12,
    ),
    ascii_escapes=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=10),
)
def test_rewriter_any_json_any_chunking(value, ascii_escapes, cuts):
    raw = json.dumps({"v": value}, ensure_ascii=ascii_escapes, separators=(",", ":"))
    out, r = rewritten(raw, [c % (len(raw) + 1) for c in cuts])
    assert out == arguments_json(json.loads(raw)) and r.done
