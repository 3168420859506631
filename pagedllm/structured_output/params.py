"""StructuredOutputsParams: what a request's output must match, with vLLM's field names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice``
    (the output is one of these strings), ``grammar`` (EBNF: llama.cpp's GBNF or Lark), or
    ``json_object=True`` (any JSON object). JSON never has free whitespace between tokens: its
    separators are ", " and ": ", or "," and ":" with ``disable_any_whitespace``.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # A Lark grammar (llguidance's) whose start rule lets a free section through before the
    # constraint, which it names @constrained: a reasoning model's thinking, up to its end tag
    # (entrypoints/openai/reasoning_parsers.py). None: the constraint applies from the first token.
    reasoning_prefix: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ValueError(f"structured outputs need exactly one of {', '.join(_KINDS)}; got {what}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured outputs: json must be a JSON schema (a dict or its JSON text).")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured outputs: regex must be a string.")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured outputs: grammar must be a string.")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured outputs: choice must be a non-empty list of strings.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured outputs: whitespace_pattern is not supported (JSON is emitted compact).")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool, str]:
        """A hashable identity of the constraint: equal keys compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(value)
        return kind, str(value), bool(self.disable_any_whitespace), self.reasoning_prefix or ""


# vLLM's earlier name for the same parameters (SamplingParams.guided_decoding).
GuidedDecodingParams = StructuredOutputsParams
