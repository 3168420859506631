"""StructuredOutputsParams -> an llguidance grammar, checked against the model's tokenizer."""

from __future__ import annotations

import json

import llguidance

from pagedllm.structured_output.params import StructuredOutputsParams

# JSON without free whitespace: a model cannot spend its token budget on blank space (a weak one
# otherwise may never close the object). The separators are json.dumps' (what models mostly
# write), or none with disable_any_whitespace (vLLM's flag for compact JSON).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_COMPACT_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params``; ValueError if its JSON schema is not JSON."""
    kind = params.kind
    options = _COMPACT_JSON_OPTIONS if params.disable_any_whitespace else _JSON_OPTIONS
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured outputs: the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise ValueError("structured outputs: a JSON schema must be a JSON object.")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", params.choice)
    try:  # EBNF: llama.cpp's GBNF or llguidance's Lark
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise ValueError(f"structured outputs: the grammar does not parse: {e}") from e


def compile_error(grammar: str, tokenizer: llguidance.LLTokenizer) -> str | None:
    """Why ``grammar`` cannot run with this tokenizer, or None."""
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    return error or None
