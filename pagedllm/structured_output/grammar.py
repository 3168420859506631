"""StructuredOutputsParams -> an llguidance grammar -> a compiled matcher, checked against the
model's tokenizer once (compiling is the check: no separate validation pass)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
import numpy as np

from pagedllm.structured_output.params import StructuredOutputsParams

# JSON without free whitespace: a model cannot spend its token budget on blank space (a weak one
# otherwise may never close the object). The separators are json.dumps' (what models mostly
# write), or none with disable_any_whitespace (vLLM's flag for compact JSON).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_COMPACT_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

# Bytes of process memory a compiled grammar holds per byte of its llguidance grammar text, and
# a floor per entry. Measured (RSS growth per compiled matcher, the default model's 49k-token
# vocabulary): about 80 for guided_choice lists of 1,000-20,000 strings, 100-180 for a
# tool_choice "required" anyOf of 200-1,500 tools, up to 150 for an object of 1,000-4,000
# properties; the largest, with a margin, so the cache never holds more than its bound.
# tests/test_structured_limits.py checks the estimate against a measurement of each shape.
BYTES_PER_GRAMMAR_BYTE = 240
ENTRY_OVERHEAD_BYTES = 64 * 1024


class GrammarError(ValueError):
    """The constraint cannot be compiled, or took too long to: the request's fault (a 400)."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: the matcher before any token (copied per sequence, never advanced
    itself) and the mask of the first token, computed once for every sequence that starts it."""

    matcher: llguidance.LLMatcher
    initial_mask: np.ndarray  # int32 [ceil(vocab / 32)]: bit t set when token t may come first
    nbytes: int  # estimated memory it holds (the cache's size bound counts this)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params``; ValueError if its JSON schema is not JSON."""
    text = _constraint_text(params)
    return text if params.reasoning_prefix is None else _after_prefix(params.reasoning_prefix, text)


def _after_prefix(prefix: str, constraint: str) -> str:
    """``constraint`` (an llguidance grammar: its JSON form or Lark text) as the grammar named
    ``constrained`` that the Lark grammar ``prefix`` refers to after its free section."""
    if constraint.lstrip().startswith("{"):
        top = json.loads(constraint)
    else:
        top = {"grammars": [{"lark_grammar": constraint}]}
    grammars = top["grammars"]
    grammars[0]["name"] = "constrained"
    top["grammars"] = [{"lark_grammar": prefix}, *grammars]
    return json.dumps(top)


def _constraint_text(params: StructuredOutputsParams) -> str:
    kind = params.kind
    options = _COMPACT_JSON_OPTIONS if params.disable_any_whitespace else _JSON_OPTIONS
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:
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


def compute_mask(matcher: llguidance.LLMatcher, words: int) -> np.ndarray:
    """The int32 mask row (``words`` words) of the tokens ``matcher`` allows next; check
    ``matcher.is_error()`` after it. Releases the GIL while llguidance computes."""
    mask = np.zeros(words, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    return mask


def compile_grammar(
    params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer, limits: llguidance.LLParserLimits, words: int
) -> CompiledGrammar:
    """Compiles ``params`` for this tokenizer (``words``: int32 words of a mask row); GrammarError
    with llguidance's reason if it cannot run. Slow for large constraints: never on the event
    loop or the engine thread."""
    try:
        grammar = grammar_text(params)
    except ValueError as e:  # also llguidance's own: a schema it cannot translate
        raise GrammarError(str(e) if str(e).startswith("structured outputs") else f"structured outputs: {e}") from e
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    mask = compute_mask(matcher, words) if not matcher.is_error() else np.zeros(words, dtype=np.int32)
    if matcher.is_error():  # a grammar error, or a parser limit its first token already exceeds
        raise GrammarError(
            f"structured outputs: the {params.kind} constraint cannot be compiled: {matcher.get_error()}"
        )
    nbytes = BYTES_PER_GRAMMAR_BYTE * len(grammar) + mask.nbytes + ENTRY_OVERHEAD_BYTES
    return CompiledGrammar(matcher, mask, nbytes)
