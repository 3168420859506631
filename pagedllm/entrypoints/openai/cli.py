"""`pagedllm serve [MODEL]`: the OpenAI-compatible server's command-line flags."""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.engine_args import add_engine_args

# Imported here so that `pagedllm` without the serve extra simply has no `serve` command
# (entrypoints/cli.py catches this ImportError).
import fastapi  # noqa: F401, E402  isort: skip
import uvicorn  # noqa: F401, E402  isort: skip


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pagedllm.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES, ServerLimits
    from pagedllm.entrypoints.openai.reasoning_parsers import PARSERS as REASONING_PARSERS
    from pagedllm.entrypoints.openai.response_store import DEFAULT_STORE_SIZE
    from pagedllm.entrypoints.openai.tool_parsers import PARSERS

    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/responses; "
        "Anthropic's /v1/messages)",
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="model to serve (same as --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on every route but "
        "/health (and /metrics); repeat the "
        "flag or separate keys by commas to accept several (default: $PAGEDLLM_API_KEY)",
    )
    p.add_argument(
        "--metrics-prefix",
        choices=["pagedllm", "vllm"],
        default="pagedllm",
        help="prefix of every /metrics name: vllm gives vLLM's names, for its dashboards (default: pagedllm)",
    )
    p.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the API key too (default: open)")
    p.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        help="Host header values to accept, '*' for any (default: the loopback names when bound to "
        "loopback without an API key, against DNS rebinding; else any)",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas behind this server, each a Ray actor with its own KV cache (on this node, "
        "or across a Ray cluster's nodes with RAY_ADDRESS set); default 1: one engine in this process",
    )
    p.add_argument(
        "--data-parallel-routing",
        choices=["prefix", "round_robin"],
        default="prefix",
        help="prefix: to the replica whose prefix cache likely holds the longest part of the prompt, "
        "balanced by load; round_robin: in turn (default: prefix)",
    )
    p.add_argument(
        "--max-step-failures",
        type=int,
        default=3,
        help="/health answers 503 after this many failed engine steps in a row (default: 3)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: the MODEL argument)",
    )
    p.add_argument(
        "--show-model-path",
        action="store_true",
        help="/v1/models gives the model's folder as root (default: the served model name)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": the model decides when to call tools (needs --tool-call-parser)',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="how tool calls are read from the model's text, in its chat template's format",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="how the model's reasoning (between its think tags) is told from its answer: returned as "
        "reasoning_content (chat), reasoning items (/v1/responses) and thinking blocks (/v1/messages)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=DEFAULT_STORE_SIZE,
        help="responses /v1/responses keeps for retrieval and previous_response_id, least recently used "
        f"evicted first; 0 keeps none (default: {DEFAULT_STORE_SIZE})",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 (default: 8 MiB)",
    )
    d = ServerLimits()
    limits = p.add_argument_group("per-request limits (larger requests get a 400 naming the field)")
    # (ServerLimits field, what it counts): flag --max-<field with dashes>, default ServerLimits'
    for field, what in (
        ("max_prompts_per_request", "prompts in one /v1/completions call"),
        ("max_seqs_per_request", "prompts x max(n, best_of)"),
        ("max_stop_strings", "stop strings"),
        ("max_stop_string_chars", "length of one stop string"),
        ("max_stop_token_ids", "stop token ids"),
        ("max_messages", "chat messages"),
        ("max_logit_bias", "logit_bias entries"),
        ("max_chars_per_token", "characters of prompt text per token it may fit, checked before tokenizing"),
        ("max_prompt_response_bytes", "estimated bytes of echoed prompts and prompt_logprobs in a response"),
        ("max_constraint_choices", "guided_choice options"),
        ("max_constraint_bytes", "bytes of an output constraint's JSON schema, regex, grammar or choices"),
    ):
        default = getattr(d, field)
        limits.add_argument(
            "--" + field.replace("_", "-"), type=int, default=default, help=f"{what} (default: {default})"
        )
    limits.add_argument(
        "--max-request-tokens",
        type=int,
        default=None,
        help="tokens one request may hold in the KV cache: prompt tokens + sequences x max_tokens, "
        "over its prompts (default: the KV cache's capacity)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted for vLLM's command lines: pagedllm logs no request contents anyway",
    )
    add_engine_args(p)
    p.set_defaults(func=_serve)
    return p


def _serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    return run_server(args)
