"""Reasoning parsers (``pagedllm serve --reasoning-parser NAME``, vLLM's names): which part of a
model's output is its reasoning (the text between its think tags) and which is the answer.

- ``deepseek_r1``: everything before ``</think>`` is reasoning, with or without an opening
  ``<think>`` in the output (DeepSeek-R1's chat template writes the opening tag into the prompt).
  An output without ``</think>`` is all reasoning (the model was cut short while thinking).
- ``qwen3``: the output must open with ``<think>`` (after blank space) for any of it to be
  reasoning; otherwise it is all content. Reasoning ends at ``</think>``; an output cut short
  before it is all reasoning, streamed or not (a streamed answer cannot take back the reasoning
  deltas it already sent).

The tags never reach the content. ``split`` is a function of the output's text so far: streamed,
each part only grows (a tag still being written is held back until it is known), so the deltas
are the new characters of each part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output has no reasoning section (so far)
    content: str


def _held_tail(text: str, tag: str) -> int:
    """Characters at the end of ``text`` that may be the start of ``tag`` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _after_start(text: str, finished: bool) -> tuple[str | None, bool]:
    """The text after a leading ``<think>`` (blank space before it allowed), and whether the text
    opens with it; (None, False) while the opening may still be being written."""
    body = text.lstrip()
    if body.startswith(THINK_START):
        return body[len(THINK_START) :], True
    if not finished and THINK_START.startswith(body):  # "", "<", "<th"...: not known yet
        return None, False
    return text, False


def _think_section(body: str, finished: bool) -> ReasoningSplit:
    """``body`` is inside the think section: reasoning up to ``</think>``, content after it."""
    end = body.find(THINK_END)
    if end >= 0:
        return ReasoningSplit(body[:end], body[end + len(THINK_END) :])
    held = 0 if finished else _held_tail(body, THINK_END)
    return ReasoningSplit(body[: len(body) - held], "")


class ReasoningParser:
    name = ""
    # A Lark rule of llguidance (structured_output/grammar.py): the reasoning section an output
    # constraint lets through freely before it applies. ``lazy``: it ends at the first </think>.
    grammar_prefix = ""

    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        """The reasoning and the content of an output's ``text``; ``finished``: its final text
        (False: what may still be a tag being written is in neither part yet)."""
        raise NotImplementedError


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    grammar_prefix = "start: reasoning @constrained\nreasoning[lazy]: /(?s:.*)<\\/think>/"

    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        body, _ = _after_start(text, finished)
        if body is None:
            return ReasoningSplit("", "")
        return _think_section(body, finished)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    grammar_prefix = (
        "start: reasoning @constrained | @constrained\nreasoning[lazy]: /[ \\t\\r\\n]*<think>(?s:.*)<\\/think>/"
    )

    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        body, opened = _after_start(text, finished)
        if body is None:
            return ReasoningSplit(None, "")
        if not opened:
            return ReasoningSplit(None, text)
        return _think_section(body, finished)


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def reasoning_parser(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(sorted(PARSERS))}") from None


def reasoning_tokens(
    parser: ReasoningParser | None, text: str, token_ids: list[int], decode: Callable[[list[int]], str]
) -> int:
    """How many of an output's generated tokens are its reasoning section (OpenAI's
    ``reasoning_tokens``): those up to and including the one that completes ``</think>``, all of
    them when the output ended while thinking, none without a reasoning section. ``decode``: the
    tokenizer's, special tokens kept (a think tag may be one)."""
    if parser is None or parser.split(text).reasoning is None:
        return 0
    if THINK_END not in text:
        return len(token_ids)
    lo, hi = 1, len(token_ids)  # the first prefix whose text holds the tag: prefixes' texts only grow
    while lo < hi:
        mid = (lo + hi) // 2
        if THINK_END in decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo
