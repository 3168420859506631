"""A request's output constraint, from any of the ways OpenAI's and vLLM's clients spell it:
OpenAI's ``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` extra body
and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.structured_output import StructuredOutputsParams
from pagedllm.structured_output.limits import constraint_size_error

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}.",
                param="response_format",
            )
        # Without a schema, OpenAI's json_schema is any JSON object.
        schema = spec.get("schema")
        return StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)
    raise APIError(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}.", param="response_format"
    )


def structured_outputs_of(
    req: Any, limits: ServerLimits | None = None
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from, or (None, None). More than one way at
    once, a malformed one, or one over ``limits``' caps is a 400 naming the field."""
    if getattr(req, "guided_whitespace_pattern", None) is not None:
        raise APIError(
            "guided_whitespace_pattern is not supported: JSON is written without free whitespace.",
            param="guided_whitespace_pattern",
        )
    builders = {
        "response_format": _from_response_format,
        "structured_outputs": lambda so: StructuredOutputsParams(**so),
        **{name: (lambda v, k=kind: StructuredOutputsParams(**{k: v})) for name, kind in _GUIDED.items()},
    }
    given: list[tuple[str, StructuredOutputsParams]] = []
    for field, build in builders.items():
        value = getattr(req, field, None)
        if value is None:
            continue
        try:
            params = build(value)
        except (TypeError, ValueError) as e:
            raise APIError(f"{field}: {e}", param=field) from e
        if params is not None:
            given.append((field, params))
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(f"Give one output constraint, not several ({names}).", param=given[1][0])
    if not given:
        return None, None
    field, params = given[0]
    check_constraint_size(params, field, limits)
    return params, field


def check_constraint_size(params: StructuredOutputsParams, field: str, limits: ServerLimits | None) -> None:
    """A 400 naming ``field`` if ``params`` is over the server's constraint caps (before any compile)."""
    limits = limits or ServerLimits()
    error = constraint_size_error(params, limits.max_constraint_choices, limits.max_constraint_bytes)
    if error is not None:
        raise APIError(f"{field}: {error}", param=field)
