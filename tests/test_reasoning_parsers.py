"""The reasoning parsers (--reasoning-parser) on fixed texts, whole and streamed in every
chunking, and the output constraint that applies only after the reasoning."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from pagedllm.entrypoints.openai.reasoning_parsers import PARSERS, reasoning_parser
from pagedllm.structured_output import StructuredOutputsParams
from pagedllm.structured_output.grammar import grammar_text

# (text, deepseek_r1's (reasoning, content), qwen3's)
CASES = [
    ("<think>plan a</think>answer", ("plan a", "answer"), ("plan a", "answer")),
    ("plan a</think>answer", ("plan a", "answer"), (None, "plan a</think>answer")),
    ("\n<think>\nx < y\n</think>\n\nok", ("\nx < y\n", "\n\nok"), ("\nx < y\n", "\n\nok")),
    ("still thinking <", ("still thinking <", ""), (None, "still thinking <")),
    ("<think>cut short </thi", ("cut short </thi", ""), ("cut short </thi", "")),
    ("just an answer", ("just an answer", ""), (None, "just an answer")),
    ("</think>", ("", ""), (None, "</think>")),
    ("<think></think>", ("", ""), ("", "")),
    ("a</think>b</think>c", ("a", "b</think>c"), (None, "a</think>b</think>c")),
    ("<thinking>no</think>yes", ("<thinking>no", "yes"), (None, "<thinking>no</think>yes")),
    ("", ("", ""), (None, "")),
    ("<", ("<", ""), (None, "<")),
]


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("case", CASES, ids=[repr(c[0]) for c in CASES])
def test_split_of_a_finished_output(name, case):
    text, deepseek, qwen3 = case
    split = reasoning_parser(name).split(text)
    assert (split.reasoning, split.content) == (deepseek if name == "deepseek_r1" else qwen3)


def _streamed(parser, chunks: list[str]) -> tuple[str, str]:
    """The reasoning and content deltas a stream of ``chunks`` sends, concatenated; every part
    must only grow (a delta is never taken back)."""
    text, reasoning, content = "", "", ""
    for i, chunk in enumerate(chunks):
        text += chunk
        split = parser.split(text, finished=i == len(chunks) - 1)
        r = split.reasoning or ""
        assert r.startswith(reasoning) and split.content.startswith(content), (chunks, i)
        reasoning, content = r, split.content
    return reasoning, content


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text", [c[0] for c in CASES if c[0]])
def test_streamed_in_every_chunking_matches_the_whole(name, text):
    parser = reasoning_parser(name)
    whole = parser.split(text)
    expected = (whole.reasoning or "", whole.content)
    assert _streamed(parser, list(text)) == expected  # a character at a time
    for cut in range(1, len(text)):  # every split in two
        assert _streamed(parser, [text[:cut], text[cut:]]) == expected
    for a in range(1, len(text)):  # every split in three
        for b in range(a + 1, len(text)):
            assert _streamed(parser, [text[:a], text[a:b], text[b:]]) == expected


def test_tags_being_written_are_held_back():
    r1, qwen3 = reasoning_parser("deepseek_r1"), reasoning_parser("qwen3")
    assert r1.split("<thi", finished=False).reasoning == ""
    assert r1.split("a </thi", finished=False).reasoning == "a "
    assert qwen3.split("  <thin", finished=False).content == ""
    assert qwen3.split("  <thin", finished=True).content == "  <thin"


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_parser("nope")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizers(tiny_llama):
    hf = AutoTokenizer.from_pretrained(tiny_llama)
    return hf, llguidance.hf.from_tokenizer(hf)


def _accepts(tokenizers, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the compiled constraint lets the whole ``text`` through and may end there."""
    hf, ll = tokenizers
    matcher = llguidance.LLMatcher(ll, grammar_text(params), log_level=0)
    return matcher.consume_tokens(hf.encode(text)) and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(regex=r"\{\"a\": [0-9]+\}"),
        StructuredOutputsParams(choice=['{"a": 1}', '{"a": 22}']),
        StructuredOutputsParams(grammar='start: "{\\"a\\": " /[0-9]+/ "}"'),
    ],
    ids=["json", "regex", "choice", "grammar"],
)
def test_constraint_applies_after_the_reasoning(tokenizers, params):
    r1 = StructuredOutputsParams(**{**params.__dict__, "reasoning_prefix": PARSERS["deepseek_r1"].grammar_prefix})
    qwen3 = StructuredOutputsParams(**{**params.__dict__, "reasoning_prefix": PARSERS["qwen3"].grammar_prefix})
    answer = '{"a": 1}'
    assert _accepts(tokenizers, params, answer)
    assert not _accepts(tokenizers, params, "<think>x</think>" + answer)  # without: from the first token
    # deepseek_r1: free text (any, "<think>" included) up to the first </think>, then the constraint
    assert _accepts(tokenizers, r1, "maybe {a} <b>\n</think>" + answer)
    assert _accepts(tokenizers, r1, "<think>x</think>" + answer)
    assert not _accepts(tokenizers, r1, "x</think>no json")
    assert not _accepts(tokenizers, r1, "x</think>" + answer + "</think>")
    assert not _accepts(tokenizers, r1, answer)  # the reasoning must end first
    # qwen3: a think section at the start, or none
    assert _accepts(tokenizers, qwen3, "<think>maybe</think>" + answer)
    assert _accepts(tokenizers, qwen3, answer)
    assert not _accepts(tokenizers, qwen3, "maybe</think>" + answer)
    assert json.loads(grammar_text(r1))["grammars"][1]["name"] == "constrained"


def test_reasoning_prefix_is_part_of_the_cache_key():
    plain = StructuredOutputsParams(json=SCHEMA)
    prefixed = StructuredOutputsParams(json=SCHEMA, reasoning_prefix=PARSERS["qwen3"].grammar_prefix)
    assert plain.key() != prefixed.key()
