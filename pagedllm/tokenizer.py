"""Tokenizer loading, incremental detokenization and stop strings."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


def load_tokenizer(path: str, config: Any = None, use_fast: bool = True):
    """transformers' AutoTokenizer for ``path``. ``config``: the model config already loaded from the
    same folder, which AutoTokenizer would otherwise load again (through AutoConfig and its imports,
    see pagedllm.models.plain_config); used only when tokenizer_config.json names the tokenizer
    class, so that the config's class plays no part in choosing it. ``use_fast=False``: the slow
    (Python) tokenizer, vLLM's tokenizer_mode="slow"."""
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"config": config} if config is not None and _names_tokenizer_class(path) else {}
    if not use_fast:  # tokenizer_mode="slow"
        kwargs["use_fast"] = False
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as e:  # transformers raises many types; say which folder failed and why
        raise ValueError(f"Could not load a tokenizer from {path!r}: {e}") from e


def _names_tokenizer_class(path: str) -> bool:
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and isinstance(cfg.get("tokenizer_class"), str)


def shareable_across_threads(tokenizer: Any) -> bool:
    """True when threads may use ``tokenizer`` at once for encode, decode and chat templates.

    A fast tokenizer's Rust backend is only written to by encode when it has truncation or padding
    set (transformers resets them per call); without either, encode and decode only read it. Slow
    (pure Python) tokenizers are not vouched for.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "truncation") or not hasattr(backend, "padding"):
        return False
    return backend.truncation is None and backend.padding is None


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, decoding only a small window per token.

    Byte-level BPE can split one character over several tokens; text is only emitted once the
    window decodes without a trailing replacement character. Stop strings are searched in the
    newly added text (plus enough of the old to catch one straddling the boundary); the text is
    cut at the stop string, which is dropped unless include_stop_str_in_output.
    """

    tokenizer: object
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    # Passed to the tokenizer's decode, as vLLM does: slow (Python) tokenizers put a space around
    # added and special tokens when True; fast tokenizers' decode has no such option and ignores it.
    spaces_between_special_tokens: bool = True
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Appends a token; returns the stop string if one now appears (text is then final).

        With check_stop False (min_tokens not reached yet) the new text is not searched.
        """
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        old_len = len(self.text)
        self.text += delta
        if not self.stop or not check_stop:
            return None
        search_from = max(0, old_len - self._max_stop_len + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop_str_in_output else self.text[:i]
        return s

    def stream_safe_len(self, finished: bool) -> int:
        """How much of ``text`` may be streamed: hold back a tail that could begin a stop string."""
        if finished or not self.stop:
            return len(self.text)
        return max(0, len(self.text) - self._max_stop_len + 1)


class TokenTexts:
    """Each token id's own text, as Logprob.decoded_token gives it: decoded alone, special tokens
    included (an EOS among the top-N shows as itself). Cached: the same few thousand tokens come
    up again and again in top-N lists."""

    def __init__(self, tokenizer: Any, max_cached: int = 65536) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._max_cached = max_cached

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < self._max_cached:
                self._cache[token_id] = s
        return s

    def fill(self, logprobs: dict | None) -> None:
        """Sets decoded_token on one position's Logprobs (token id -> Logprob)."""
        if logprobs:
            for t, lp in logprobs.items():
                lp.decoded_token = self(t)
