"""ServerLimits and the body-size cap: what one request may cost the server before it is refused.

Its own module because the caps are configuration, shared by the command line (cli.py), the app
factory (api_server.py) and the serving layer that enforces them (serving_engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# The request body's size cap (BodyLimitMiddleware, middleware.py): --max-request-body-bytes.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass
class ServerLimits:
    """Per-request caps, each a `pagedllm serve` flag (see cli.py). They bound the work and memory one
    request can cost the server before it is rejected with a 400 naming the field."""

    max_prompts_per_request: int = 256
    max_seqs_per_request: int = 1024  # prompts x max(n, best_of)
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_messages: int = 2048
    max_logit_bias: int = 300  # entries; OpenAI's cap
    # Characters a prompt's text may hold per token it could fit (of the context, and of
    # max_request_tokens over a request's prompts), checked before tokenizing: see serving_engine.py
    max_chars_per_token: int = 16
    # Estimated bytes of a response's prompt-derived part (echo in every choice, prompt_logprobs):
    # see response_budget.py
    max_prompt_response_bytes: int = 4 * 2**20
    # An output constraint (guided_*, structured_outputs, response_format, a required / named
    # tool_choice): choices (OpenAI allows 1,000 enum values), and bytes of its schema, regex,
    # grammar or choices; they bound its compile time and memory (structured_output/limits.py).
    max_constraint_choices: int = 1000
    max_constraint_bytes: int = 64 * 1024
    # prompt tokens + sequences x max_tokens, summed over the prompts; None: the KV cache's capacity
    max_request_tokens: int | None = None
