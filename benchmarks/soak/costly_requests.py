"""The amplification review's request classes, mixed into the soak's streaming traffic.

Each class is a small request that once cost the server far more than its size: the soak sends
them beside normal streams and checks each gets the answer its contract says (a 4xx naming the
field, or a 200 whose cost is bounded) and never a 5xx, a cut stream or a stream without [DONE].
The latency of the normal streams beside them is what the soak compares with a run without them.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass

import httpx

VOCAB = 49152  # the default model's vocabulary
# The second tool's schema recurses: a logit_bias on "[" makes the model nest deeper than Python's
# JSON parser reads (a RecursionError and a 500 in the old tool-call parser).
NEST = {
    "$id": "urn:nest",  # the schema is embedded in the tool-call grammar: its refs need a base
    "type": "object",
    "properties": {"x": {"$ref": "#/$defs/n"}},
    "required": ["x"],
    "additionalProperties": False,
    "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
}
OPEN_BRACKET_IDS = (75, 32803)  # "[" and "[[" in the default model's vocabulary


@dataclass(frozen=True)
class CostlyRequest:
    name: str
    path: str
    body: Callable[[random.Random, str], dict | None]  # (rng, model) -> JSON body (None: a GET)
    status: int  # the answer its contract gives: 400 naming ``param``, or 200
    param: str | None = None
    stream: bool = False
    weight: float = 1.0  # relative frequency among the costly requests


def _words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(string.ascii_lowercase) for _ in range(10)) for _ in range(n)]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, VOCAB) for _ in range(n)]


def _chat(model: str, text: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


KINDS: list[CostlyRequest] = [
    # 1. prompt logprobs over n choices: 23 KB that asked for 174 MiB (now once per prompt, budgeted)
    CostlyRequest(
        "prompt_logprobs_n32",
        "/v1/completions",
        lambda r, m: {"model": m, "prompt": _ids(r, 4000), "n": 32, "prompt_logprobs": 20},
        400,
        "prompt_logprobs",
    ),
    CostlyRequest(
        "echo_logprobs_n32",
        "/v1/completions",
        lambda r, m: {"model": m, "prompt": _ids(r, 4000), "n": 32, "echo": True, "logprobs": 5, "max_tokens": 0},
        400,
        "logprobs",
    ),
    # 2-3. constraints over their caps, refused before anything compiles
    CostlyRequest(
        "guided_choice_100k",
        "/v1/completions",
        lambda r, m: {"model": m, "prompt": "Pick:", "max_tokens": 8, "guided_choice": _words(r, 100_000)},
        400,
        "guided_choice",
        weight=0.5,
    ),
    CostlyRequest(
        "json_schema_over_64KiB",
        "/v1/chat/completions",
        lambda r, m: _chat(
            m,
            "Give me JSON.",
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": {"enum": _words(r, 7000)}},
            },
        ),
        400,
        "response_format",
    ),
    # 2-3. distinct constraints at the cap: compiled off the engine thread, the cache bounded in MB
    CostlyRequest(
        "guided_choice_1000_distinct",
        "/v1/completions",
        lambda r, m: {"model": m, "prompt": "Pick:", "max_tokens": 6, "guided_choice": _words(r, 1000)},
        200,
        stream=True,
    ),
    # 5. tool_choice "required" with a recursive schema pushed to nest deeper than JSON parses
    CostlyRequest(
        "recursive_tool_nesting",
        "/v1/chat/completions",
        lambda r, m: _chat(
            m,
            "Nest.",
            tools=[{"type": "function", "function": {"name": "nest", "parameters": NEST}}],
            tool_choice="required",
            max_tokens=160,
            logit_bias={str(t): 100 for t in OPEN_BRACKET_IDS},
        ),
        200,
        stream=True,
    ),
    # 5. tool_choice "required" with allowed_token_ids that exclude the grammar's tokens
    CostlyRequest(
        "required_tool_without_its_tokens",
        "/v1/chat/completions",
        lambda r, m: _chat(
            m,
            "What time is it?",
            tools=[{"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}],
            tool_choice="required",
            max_tokens=8,
            allowed_token_ids=list(range(1000, 1100)),
        ),
        200,
        stream=True,
    ),
    # 6. token controls: over their caps a 400; at them, masks built once at admission
    CostlyRequest(
        "allowed_token_ids_over_vocab",
        "/v1/completions",
        lambda r, m: {"model": m, "prompt": "hi", "n": 16, "allowed_token_ids": list(range(VOCAB)) * 2},
        400,
        "allowed_token_ids",
        weight=0.5,
    ),
    CostlyRequest(
        "logit_bias_301",
        "/v1/completions",
        lambda r, m: {"model": m, "prompt": "hi", "logit_bias": {str(t): 1.0 for t in range(301)}},
        400,
        "logit_bias",
    ),
    CostlyRequest(
        "n16_every_token_allowed_300_biases",
        "/v1/completions",
        lambda r, m: {
            "model": m,
            "prompt": "Once upon a time",
            "n": 16,
            "max_tokens": 8,
            "temperature": 1.0,
            "allowed_token_ids": list(range(VOCAB)),
            "logit_bias": {str(t): -1.0 for t in r.sample(range(VOCAB), 300)},
        },
        200,
        weight=0.5,
    ),
    # 7. prompts over the character budget: refused before tokenizing
    CostlyRequest(
        "prompt_1_3M_chars",
        "/v1/completions",
        lambda r, m: {"model": m, "prompt": "The quick brown fox. " * 62_000, "max_tokens": 1},
        400,
        "prompt",
        weight=0.5,
    ),
    # 10. /metrics scrapes, read from the engine's published snapshot
    CostlyRequest("metrics_scrape", "/metrics", lambda r, m: None, 200, weight=2.0),
]


async def send(c: httpx.AsyncClient, kind: CostlyRequest, rng: random.Random, model: str) -> str | None:
    """Sends one request of ``kind``; returns None when the answer is what its contract says, else
    a description of what came back."""
    body = kind.body(rng, model)
    if body is None:
        r = await c.get(kind.path)
        return None if r.status_code == kind.status else f"{kind.name}: {r.status_code} {r.text[:200]}"
    raw = json.dumps({**body, "stream": kind.stream}, separators=(",", ":")).encode()
    headers = {"content-type": "application/json"}
    if not kind.stream or kind.status != 200:
        r = await c.post(kind.path, content=raw, headers=headers)
        if r.status_code != kind.status:
            return f"{kind.name}: {r.status_code} {r.text[:200]}"
        if kind.param is not None and r.json().get("error", {}).get("param") != kind.param:
            return f"{kind.name}: 400 without param {kind.param}: {r.text[:200]}"
        return None
    async with c.stream("POST", kind.path, content=raw, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return f"{kind.name}: {r.status_code} {r.text[:200]}"
        done = False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith('data: {"error"'):
                return f"{kind.name}: stream error event {line[:200]}"
        return None if done else f"{kind.name}: stream ended without [DONE]"


def pick(rng: random.Random) -> CostlyRequest:
    return rng.choices(KINDS, weights=[k.weight for k in KINDS])[0]
