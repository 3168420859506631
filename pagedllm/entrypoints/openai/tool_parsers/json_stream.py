"""A JSON value re-written as it is read: the prefix of ``arguments_json(json.loads(raw))`` that a
prefix of ``raw`` already determines.

A call's ``function.arguments`` is the arguments object re-serialized (``json.dumps`` with
``ensure_ascii=False``: ``", "`` and ``": "`` separators, strings re-escaped, numbers as Python
writes them), not the model's text; streamed argument deltas must add up to exactly that. So the
model's text is read token by token: structure and string characters are written as soon as they
are read, a number or literal once the character after it ends it, an escape once complete (a
UTF-16 surrogate pair once its second half is known or ruled out).

Anything ``json.loads`` or ``arguments_json`` would refuse (bad syntax, NaN, an int too long, a
control character in a string), a duplicate key (json keeps the last value, at the first one's
place) or nesting past ``MAX_DEPTH`` stops the writing (``stopped``): the output so far stays a
prefix of the final arguments, or the call turns out not to be one; the finished text decides.
"""

from __future__ import annotations

import json
import re
from json.encoder import encode_basestring

from pagedllm.entrypoints.openai.tool_parsers.base import JSON_ERRORS, arguments_json

MAX_DEPTH = 64  # deeper arguments are sent when the call is complete
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789-+.eE")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"true": "true", "false": "false", "null": "null"}


class JsonRewriter:
    """Feed it the growing raw text of one JSON value (from its first character); it returns
    what more of the value's canonical form is known."""

    def __init__(self) -> None:
        self.pos = 0  # characters of the raw text read
        self.done = False  # the value is complete (``pos`` is just past it)
        self.stopped = False
        self._stack: list[str] = []  # open containers, "{" or "["
        self._keys: list[set[str]] = []  # per open object: its keys so far
        self._expect = "value"  # value | value_or_end | key | key_or_end | colon | comma_or_end
        self._mode = ""  # "" (between tokens) | str | num | lit
        self._is_key = False
        self._buf = ""  # the number or literal so far; or the string's pending escape
        self._chars: list[str] = []  # decoded string characters not yet written
        self._key = ""  # the key being read
        self._high: int | None = None  # a high surrogate waiting for its low half

    def feed(self, raw: str) -> str:
        out: list[str] = []
        while self.pos < len(raw) and not self.done and not self.stopped:
            ch = raw[self.pos]
            if self._mode == "str":
                self._string_char(ch, out)
            elif self._mode in ("num", "lit"):
                if ch in _NUMBER_CHARS if self._mode == "num" else ch.isalpha():
                    self._buf += ch
                else:  # the token ended: the character is read again between tokens
                    self._end_scalar(out)
                    continue
            else:
                self._structural(ch, out)
            self.pos += 1
        if self._mode == "str" and self._chars:
            self._flush(out)
        return "".join(out)

    def _stop(self) -> None:
        self.stopped = True

    def _structural(self, ch: str, out: list[str]) -> None:
        if ch in " \t\n\r":
            return
        expect = self._expect
        if expect in ("value", "value_or_end"):
            if ch == "]" and expect == "value_or_end":
                self._close(ch, out)
            elif ch in "{[":
                if len(self._stack) >= MAX_DEPTH:
                    return self._stop()
                self._stack.append(ch)
                if ch == "{":
                    self._keys.append(set())
                self._expect = "key_or_end" if ch == "{" else "value_or_end"
                out.append(ch)
            elif ch == '"':
                self._mode, self._is_key = "str", False
                out.append(ch)
            elif ch in "-0123456789":
                self._mode, self._buf = "num", ch
            elif ch in "tfn":
                self._mode, self._buf = "lit", ch
            else:
                self._stop()
        elif expect in ("key", "key_or_end"):
            if ch == "}" and expect == "key_or_end":
                self._close(ch, out)
            elif ch == '"':
                self._mode, self._is_key, self._key = "str", True, ""
                out.append(ch)
            else:
                self._stop()
        elif expect == "colon":
            if ch != ":":
                return self._stop()
            out.append(": ")
            self._expect = "value"
        elif ch == ",":  # comma_or_end
            out.append(", ")
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif ch == ("}" if self._stack[-1] == "{" else "]"):
            self._close(ch, out)
        else:
            self._stop()

    def _close(self, ch: str, out: list[str]) -> None:
        if self._stack.pop() == "{":
            self._keys.pop()
        out.append(ch)
        self._value_ended()

    def _value_ended(self) -> None:
        if self._stack:
            self._expect = "comma_or_end"
        else:
            self.done = True

    def _end_scalar(self, out: list[str]) -> None:
        token, mode = self._buf, self._mode
        self._mode, self._buf = "", ""
        if mode == "lit":
            if token not in _LITERALS:
                return self._stop()
            out.append(token)
        else:
            if not _NUMBER.fullmatch(token):
                return self._stop()
            try:
                out.append(arguments_json(json.loads(token)))  # as Python writes it: 1E2 -> 100.0
            except JSON_ERRORS:  # an int longer than Python converts, a float out of range
                return self._stop()
        self._value_ended()

    def _string_char(self, ch: str, out: list[str]) -> None:
        if self._buf:  # inside an escape
            self._buf += ch
            if self._buf[1] != "u":
                if ch not in _SIMPLE_ESCAPES:
                    return self._stop()
                self._buf = ""
                return self._decoded(_SIMPLE_ESCAPES[ch])
            if ch not in _HEX and len(self._buf) > 2:
                return self._stop()
            if len(self._buf) == 6:
                code, self._buf = int(self._buf[2:], 16), ""
                self._code(code)
            return None
        if ch == "\\":
            self._buf = ch
        elif ch == '"':
            self._pending_high()
            self._flush(out)
            out.append('"')
            self._mode = ""
            if self._is_key:
                if self._key in self._keys[-1]:  # json keeps the last value, at the first's place
                    return self._stop()
                self._keys[-1].add(self._key)
                self._expect = "colon"
            else:
                self._value_ended()
        elif ch < " ":  # json reads strictly: a raw control character is an error
            self._stop()
        else:
            self._decoded(ch)
        return None

    def _code(self, code: int) -> None:
        """A \\uXXXX escape: a surrogate pair's halves combine, as json's scanner does."""
        if self._high is not None and 0xDC00 <= code <= 0xDFFF:
            code, self._high = 0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00), None
            self._chars.append(chr(code))
            return
        self._pending_high()
        if 0xD800 <= code <= 0xDBFF:
            self._high = code
        else:
            self._chars.append(chr(code))

    def _decoded(self, ch: str) -> None:
        self._pending_high()
        self._chars.append(ch)

    def _pending_high(self) -> None:
        if self._high is not None:  # not followed by its low half: stays alone
            self._chars.append(chr(self._high))
            self._high = None

    def _flush(self, out: list[str]) -> None:
        text = "".join(self._chars)
        self._chars = []
        if self._is_key:
            self._key += text
        out.append(encode_basestring(text)[1:-1])
