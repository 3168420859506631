"""What one output constraint may cost: size caps checked before anything compiles, and the
parser limits that bound each compile and each token mask.

llguidance cannot be interrupted once it compiles (its Rust code holds no cancellation point),
so compile time is bounded by bounding its inputs: the server's caps (`pagedllm serve
--max-constraint-choices / --max-constraint-bytes`, checked here; measured on the default
model's 49k-token vocabulary, 2 cores: a 1,000-string choice compiles in 0.02 s, a 64 KiB
tool_choice "required" schema in 0.1 s, a 33 KiB object of 1,000 properties in 0.2 s, where
20,000 strings took 1 s and 100,000 took 12 s before llguidance gave up) and by llguidance's fuel
limits, which turn a pathological grammar into an error instead of a long computation.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

import llguidance

from pagedllm.structured_output.params import StructuredOutputsParams

# Lazily built lexer states per matcher: llguidance's default (250,000, 1-2 kB each) lets one
# grammar grow by hundreds of MB while it decodes; 20,000 leaves JSON schemas room to spare.
MAX_LEXER_STATES = 20_000


def constraint_size_error(params: StructuredOutputsParams, max_choices: int, max_bytes: int) -> str | None:
    """Why ``params`` is too large to compile, or None: more than ``max_choices`` choices, or more
    than ``max_bytes`` bytes of text (a JSON schema's JSON, a regex, a grammar, the choices together)."""
    kind = params.kind
    if kind == "choice":
        if len(params.choice) > max_choices:
            return f"{len(params.choice)} choices; at most {max_choices} are allowed."
        size = sum(len(c.encode("utf-8", "surrogatepass")) for c in params.choice)
        what = "the choices together are"
    elif kind == "json_object":
        return None
    else:
        value = getattr(params, kind)
        if not isinstance(value, str):  # a schema as a dict: its JSON text
            value = json.dumps(value, ensure_ascii=False)
        size = len(value.encode("utf-8", "surrogatepass"))
        what = {"json": "the JSON schema is", "regex": "the regex is", "grammar": "the grammar is"}[kind]
    if size > max_bytes:
        return f"{what} {size} bytes; at most {max_bytes} are allowed."
    return None


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's limits for every compile and mask. verbose_errors=False: its messages then
    carry no grammar or parser state (they reach the client, never the log)."""
    return llguidance.LLParserLimits(max_lexer_states=MAX_LEXER_STATES, verbose_errors=False)


def _env_number(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError as e:
        raise ValueError(f"${name} must be a number, got {value!r}.") from e
    if number < 0:
        raise ValueError(f"${name} must be >= 0, got {value!r}.")
    return number


@dataclass(frozen=True)
class CompileSettings:
    """The engine's compile budget, from the environment (as vLLM's VLLM_XGRAMMAR_CACHE_MB)."""

    cache_bytes: int  # $PAGEDLLM_GRAMMAR_CACHE_MB: compiled grammars (and compile errors) kept
    timeout_s: float  # $PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT_S: a request waits this long for its compile
    workers: int  # $PAGEDLLM_GRAMMAR_COMPILE_THREADS: compiles at once (the rest queue)

    @classmethod
    def from_env(cls) -> CompileSettings:
        cores = os.cpu_count() or 2
        return cls(
            cache_bytes=int(_env_number("PAGEDLLM_GRAMMAR_CACHE_MB", 512) * 2**20),
            timeout_s=_env_number("PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT_S", 10.0),
            workers=max(1, int(_env_number("PAGEDLLM_GRAMMAR_COMPILE_THREADS", max(1, min(4, cores // 4))))),
        )


# Niceness of the compile and mask threads: when cores are short, the engine's own threads (the
# forward every request waits for) run first; grammar work takes what is left.
BACKGROUND_NICENESS = 10


def lower_thread_priority() -> None:
    """A thread pool's initializer: this thread yields the CPU to the engine's (Linux sets a
    niceness per thread; elsewhere, or where it is not allowed, nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
    except (AttributeError, OSError):
        pass
