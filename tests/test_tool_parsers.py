"""The tool-call parsers (``--tool-call-parser``) on the formats' documented examples: whole and
streamed in any chunking, malformed output as text, several calls, nested arguments, unicode.

Streaming is checked as the servers stream: while the text grows, its first
``streamable_len(text)`` characters go out as content; the finished text then either has calls
(sent whole, with the text before them) or is all content. Whatever the chunking, the content
and calls streamed must be those of the whole text, and a call's marker never content.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.tool_calls import ToolPlan
from pagedllm.entrypoints.openai.tool_parsers import (
    PARSERS,
    MistralToolParser,
    PythonicToolParser,
    Qwen3XmlToolParser,
    tool_parser,
)
from pagedllm.entrypoints.openai.tool_parsers.qwen3_xml import convert


def tool(name: str, **properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


TOOLS = [
    tool("get_current_weather", city={"type": "string"}, state={"type": "string"}, unit={"enum": ["c", "f"]}),
    tool("add", a={"type": "number"}, b={"type": "integer"}),
    tool(
        "search",
        query={"type": "string"},
        limit={"anyOf": [{"type": "integer"}, {"type": "null"}]},
        exact={"type": "boolean"},
        filters={"type": "object"},
        tags={"type": "array", "items": {"type": "string"}},
    ),
]


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser_name: str, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    """(content, calls) a client receives when ``text`` arrives in chunks ending at ``cuts``."""
    plan = ToolPlan("auto", TOOLS, parser=tool_parser(parser_name))
    sent = 0
    for cut in sorted(set(cuts)):
        if 0 < cut < len(text):
            shown = plan.streamable_len(text[:cut])
            assert shown <= cut
            sent = max(sent, shown)
    content, calls = plan.calls_of(text)
    sent = max(sent, plan.streamable_len(text) if calls else len(text))
    return text[:sent], calls_of(calls)


def check_streaming(parser_name: str, text: str, cuts_list) -> None:
    content, calls = ToolPlan("auto", TOOLS, parser=tool_parser(parser_name)).calls_of(text)
    for cuts in cuts_list:
        got_content, got_calls = streamed(parser_name, text, cuts)
        assert got_calls == calls_of(calls), cuts
        if calls:  # the text before the calls (what the servers strip, a client would see as sent)
            assert got_content.strip() == (content or ""), cuts
        else:
            assert got_content == text, cuts


def every_chunking(text: str):
    yield list(range(len(text)))  # a character at a time
    yield []  # all at once
    for i in range(1, len(text)):  # two chunks, split anywhere
        yield [i]


MISTRAL = [  # vLLM's and Mistral's examples: before v11 (a JSON list), v11 and later ([ARGS])
    (
        '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"city": "San Francisco", "state": "CA", '
        '"unit": "f"}}]',
        None,
        [("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "f"})],
    ),
    (
        '[TOOL_CALLS] [{"name": "add", "arguments":{"a": 3.5, "b": 4}}, '
        '{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        None,
        [("add", {"a": 3.5, "b": 4}), ("add", {"a": 1, "b": 2})],
    ),
    ('[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}', None, [("add", {"a": 3.5, "b": 4})]),
    (
        'Let me compute both.[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]search[ARGS]{"query": "Zürich 東京", '
        '"filters": {"range": {"from": [1, 2], "to": {"x": null}}}}',
        "Let me compute both.",
        [
            ("add", {"a": 1, "b": 2}),
            ("search", {"query": "Zürich 東京", "filters": {"range": {"from": [1, 2], "to": {"x": None}}}}),
        ],
    ),
    ('[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1, "b": 2}', None, [("add", {"a": 1, "b": 2})]),
    ('[TOOL_CALLS]add{"a": 1, "b": 2}', None, [("add", {"a": 1, "b": 2})]),  # [ARGS] decoded away
]
PYTHONIC = [  # vLLM's documented example, then nested literals and unicode
    (
        "[get_weather(city='San Francisco', metric='celsius'), get_weather(city='Seattle', metric='celsius')]",
        [
            ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
            ("get_weather", {"city": "Seattle", "metric": "celsius"}),
        ],
    ),
    ("[get_time()]", [("get_time", {})]),
    (
        ' [search(query="café ☕ 東京", filters={"a": [1, 2.5, None, True], "b": {"c": (3, -4)}}, exact=False)]\n',
        [
            (
                "search",
                {"query": "café ☕ 東京", "filters": {"a": [1, 2.5, None, True], "b": {"c": [3, -4]}}, "exact": False},
            )
        ],
    ),
]
QWEN3_XML = [  # Qwen3-Coder's chat template's example of the format, then typed and several calls
    (
        "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
        "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
        "</parameter>\n</function>\n</tool_call>",
        None,
        [
            (
                "example_function_name",
                {
                    "example_parameter_1": "value_1",
                    "example_parameter_2": "This is the value for the second parameter\nthat can span\nmultiple lines",
                },
            )
        ],
    ),
    (
        "I'll look both up.\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
        "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n"
        "2.5\n</parameter>\n<parameter=b>\n7\n</parameter>\n</function>\n</tool_call>",
        "I'll look both up.",
        [("get_current_weather", {"city": "São Paulo", "unit": "c"}), ("add", {"a": 2.5, "b": 7})],
    ),
    (
        "<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n<parameter=limit>\nnull\n</parameter>\n"
        "<parameter=exact>\nTrue\n</parameter>\n<parameter=filters>\n{'lang': 'fr', 'deep': {'n': [1, {\"m\": 2}]}}\n"
        '</parameter>\n<parameter=tags>\n["a", "ü"]\n</parameter>\n<parameter=other>\n3\n</parameter>\n'
        "</function>\n</tool_call>",
        None,
        [
            (
                "search",
                {
                    "query": "42",  # a string, as its schema says
                    "limit": None,
                    "exact": True,
                    "filters": {"lang": "fr", "deep": {"n": [1, {"m": 2}]}},
                    "tags": ["a", "ü"],
                    "other": "3",  # not in the schema: the text
                },
            )
        ],
    ),
]

EXAMPLES = (
    [("mistral", text, content, calls) for text, content, calls in MISTRAL]
    + [("pythonic", text, None, calls) for text, calls in PYTHONIC]
    + [("qwen3_xml", text, content, calls) for text, content, calls in QWEN3_XML]
)
MALFORMED = {
    "mistral": [
        "[TOOL_CALLS]",
        "[TOOL_CALLS][{not json}]",
        '[TOOL_CALLS][{"name": 3, "arguments": {}}]',
        '[TOOL_CALLS][{"name": "add", "arguments": [1]}]',
        '[TOOL_CALLS]add[ARGS]{"a": 1} and more',
        '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]oops',
        "[TOOL_CALLS]add[ARGS]" + "[" * 5000,
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}]",
        "Mistral writes [TOOL_CALLS] here, then prose.",
    ],
    "pythonic": [
        "[1, 2]",
        "[]",
        "[f(1)]",  # positional arguments
        "[f(**k)]",
        "[f(x=y)]",  # a name, not a literal
        "[f(x=__import__('os').system('true'))]",
        "[f(x={1, 2})]",  # a set: not JSON
        "[f(x=b'raw')]",
        "[f(x=1j)]",
        "[f(x=1e999)]",  # infinity: not JSON
        "[f(x={(1, 2): 3})]",
        "[os.system(x=1)]",
        "[f(x=1)",
        "[f(x=1)] trailing",
        "[" * 5000 + "]" * 5000,
        "[f(x=" + "[" * 5000 + "]" * 5000 + ")]",
        "[f(x=" + "9" * 5000 + ")]",
        "[see note 1] for details",
    ],
    "qwen3_xml": [
        "<tool_call>",
        "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>",  # no function
        "<tool_call>\nprose\n<function=add>\n</function>\n</tool_call>",
        "<tool_call>\n<function=add>\nprose\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\nprose\n</tool_call>",
        "<tool_call>\n<function=add>\n</function>\n<function=add>\n</function>\n</tool_call>",
    ],
}


def test_registered_with_vllms_names():
    assert {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml", "qwen3_coder"} <= set(PARSERS)
    assert type(tool_parser("qwen3_coder")).__mro__[1] is Qwen3XmlToolParser
    with pytest.raises(ValueError, match="available"):
        tool_parser("nope")


@pytest.mark.parametrize(("name", "text", "content", "calls"), EXAMPLES)
def test_documented_examples(name, text, content, calls):
    got_content, got_calls = tool_parser(name).extract(text, TOOLS)
    assert (got_content, calls_of(got_calls)) == (content, calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), EXAMPLES)
def test_examples_streamed_in_every_chunking(name, text, content, calls):
    check_streaming(name, text, every_chunking(text))


@pytest.mark.parametrize(("name", "text"), [(n, t) for n, texts in MALFORMED.items() for t in texts])
def test_malformed_output_is_text(name, text):
    assert tool_parser(name).extract(text, TOOLS) == (text, [])
    check_streaming(name, text, [list(range(0, len(text), 7)), []])


@pytest.mark.parametrize("name", ["mistral", "pythonic", "qwen3_xml"])
def test_plain_text_streams_as_it_comes(name):
    text = "The weather in Paris is sunny, 22°C. Anything else?"
    parser = tool_parser(name)
    assert parser.extract(text, TOOLS) == (text, [])
    assert parser.streamable_len(text) == len(text)
    check_streaming(name, text, every_chunking(text))


def test_markers_are_held_back_never_content():
    mistral, qwen = MistralToolParser(), Qwen3XmlToolParser()
    assert mistral.streamable_len("Sure. [TOOL") == len("Sure. ")
    assert mistral.streamable_len('Sure. [TOOL_CALLS]add[ARGS]{"a"') == len("Sure. ")
    assert mistral.streamable_len("See [1] below") == len("See [1] below")
    assert qwen.streamable_len("Ok <tool_c") == len("Ok ")
    assert qwen.streamable_len("Ok <tool_call>\n<function=a") == len("Ok ")
    pythonic = PythonicToolParser()
    assert pythonic.streamable_len("  [get_wea") == 0 and pythonic.streamable_len("") == 0
    assert pythonic.streamable_len("Paris") == 5


def test_mistral_ids_are_what_its_templates_accept():
    _, calls = MistralToolParser().extract('[TOOL_CALLS]add[ARGS]{}[TOOL_CALLS][{"name": "add", "arguments": {}}]')
    assert len(calls) == 2 and all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    assert MistralToolParser().extract("[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{}")[1][0].id == "a1b2c3d4e"
    assert MistralToolParser.keeps_special_tokens and not PythonicToolParser.keeps_special_tokens


def test_qwen3_xml_values_follow_the_schema():
    assert convert("12", {"type": "integer"}) == 12
    assert convert("12.0", {"type": "integer"}) == 12
    assert convert("twelve", {"type": "integer"}) == "twelve"  # not of its type: the text
    assert convert("1e3", {"type": "number"}) == 1000.0
    assert convert("NaN", {"type": "number"}) == "NaN"
    assert convert("FALSE", {"type": "boolean"}) is False
    assert convert("null", {"type": ["string", "null"]}) is None
    assert convert("null", {"type": "string"}) == "null"
    assert convert(" 5 ", {"enum": [5, 6]}) == 5
    assert convert("[1, 2]", {"type": "object"}) == "[1, 2]"
    assert convert('{"a": 1}', {"$ref": "#/defs/x"}) == {"a": 1}
    assert convert("  spaced  ", None) == "  spaced  "


@settings(max_examples=40, deadline=None)
@given(
    example=st.sampled_from(EXAMPLES),
    cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=12),
)
def test_any_chunking_hypothesis(example, cuts):
    name, text, _, _ = example
    check_streaming(name, text, [[c % len(text) for c in cuts]])
