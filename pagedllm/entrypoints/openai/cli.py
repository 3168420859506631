"""`pagedllm serve [MODEL]`: the OpenAI-compatible server's command-line flags."""

from __future__ import annotations

import argparse

from pagedllm.entrypoints.engine_args import add_engine_args

# Imported here so that `pagedllm` without the serve extra simply has no `serve` command
# (entrypoints/cli.py catches this ImportError).
import fastapi  # noqa: F401, E402  isort: skip
import uvicorn  # noqa: F401, E402  isort: skip


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pagedllm.entrypoints.openai.api_server import DEFAULT_MAX_BODY_BYTES

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="model to serve (same as --model)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PAGEDLLM_API_KEY)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: the MODEL argument)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 (default: 8 MiB)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    add_engine_args(p)
    p.set_defaults(func=_serve)
    return p


def _serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    return run_server(args)
