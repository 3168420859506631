"""OpenAI's error shape, and the readable 400s made from what rejects a request.

Every error the server answers has the shape {"error": {"message", "type", "param", "code"}}:
APIError carries it from anywhere in the serving code, and the functions here turn pydantic's
validation errors and the engine's ValueErrors into it, naming the field at fault. Apart from the
request shapes (protocol.py) because every layer raises these, not only request parsing.
"""

from __future__ import annotations

import re
import reprlib
from typing import Any


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or ("server_error" if status_code >= 500 else "invalid_request_error")
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_from_value_error(e: Exception, fields: set[str]) -> APIError:
    """Maps a ValueError from SamplingParams / LLMEngine.add_request to a 400.

    SamplingParams' messages begin with the field name ("temperature must be >= 0, got -1."),
    which becomes ``param``; context-length errors get OpenAI's code.
    """
    msg = str(e)
    m = re.match(r"(\w+) ", msg)
    param = m.group(1) if m and m.group(1) in fields else None
    code = "context_length_exceeded" if "maximum context length" in msg else None
    return APIError(msg, 400, param=param, code=code)


def validation_error_message(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message (and the offending field) from pydantic/FastAPI validation errors."""
    by_field: dict[str, list[dict]] = {}
    for err in errors:
        if err.get("type") == "prompt_or_messages":
            return str(err.get("msg")), "prompt"
        if err.get("type") in ("invalid_unicode", "too_deep"):  # check_json_value's: already readable
            param = (err.get("ctx") or {}).get("param")
            return str(err.get("msg")), (None if param == "body" else param)
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "extra_forbidden" and len(loc) == 1:
            top = ([x for x in e.get("loc", ()) if x != "body"] for e in errors if e.get("type") == "extra_forbidden")
            unknown = [str(t[0]) for t in top if len(t) == 1]
            names = ", ".join(f"'{n}'" for n in unknown)
            return (
                f"Unsupported request field(s) {names}: this server cannot honour them, and does not "
                "ignore fields that could change the result.",
                unknown[0],
            )
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"The request body is not valid JSON{': ' + str(detail) if detail else ''}.", None
        by_field.setdefault(loc[0] if loc else "", []).append(err)
    parts = []
    for field, errs in by_field.items():
        if not field:
            e = errs[0]
            if e.get("type") == "missing":
                parts.append("The request body must be a JSON object.")
            else:
                parts.append(f"Invalid request body: {e.get('msg')}.")
            continue
        e = errs[0]
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "missing":
            parts.append(f"'{loc}' is a required property.")
        elif len(errs) > 1:  # a union field: every alternative failed
            parts.append(f"Invalid type for '{field}': got {short_repr(e.get('input'))} ({e.get('msg')}).")
        else:
            parts.append(f"Invalid value for '{loc}': {e.get('msg')} (got {short_repr(e.get('input'))}).")
    first = next(iter(by_field), None)
    return " ".join(parts) or "Invalid request.", first or None


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxstring, _REPR.maxlist, _REPR.maxdict, _REPR.maxother = 40, 6, 4, 40


def short_repr(value: Any) -> str:
    """A bounded repr: the offending value may be a megabyte-long list."""
    return _REPR.repr(value)
