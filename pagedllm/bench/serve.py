"""`pagedllm bench serve`: load an OpenAI-compatible server with Poisson arrivals, like vLLM's bench serve.

Each request goes to /v1/completions with a token-id prompt, ``max_tokens``, ``ignore_eos: true``
and ``stream: true`` (so the work is fixed by the workload, whatever the model says), through
httpx.AsyncClient. Arrivals follow a Poisson process of ``--request-rate`` requests/s (``inf``:
all at once), optionally capped at ``--max-concurrency`` in flight. Works against pagedllm and
vLLM alike.

Measured per request: TTFT (time to the first streamed chunk), ITL (gaps between chunks), TPOT
((e2e - TTFT) / (output tokens - 1)) and E2E latency; reported as mean / median / p99 in ms,
with request and token throughput, as a markdown table and (``--result-json``) a JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

from pagedllm.bench.workloads import load_workload

DEFAULT_VOCAB = 49152  # the anchors' tokenizer (SmolLM2); pass the model's own with --vocab-size


# ---- workloads ---------------------------------------------------------------------------
def load_requests(args: argparse.Namespace) -> list[dict]:
    return load_workload(
        args.workload,
        args.num_prompts,
        args.seed,
        args.vocab_size,
        input_len=args.input_len,
        output_len=args.output_len,
    )


# ---- the client --------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def send_request(
    client: httpx.AsyncClient, url: str, model: str, req: dict, headers: dict[str, str]
) -> RequestResult:
    prompt = req.get("prompt_token_ids", req.get("prompt"))
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req["max_tokens"],
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else 0)
    start = last = time.perf_counter()
    usage = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return res
                usage = chunk.get("usage") or usage
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = int(usage["completion_tokens"]) if usage else int(req["max_tokens"])
    if usage and not res.prompt_len:
        res.prompt_len = int(usage.get("prompt_tokens", 0))
    res.ok = res.ttft > 0.0
    if not res.ok:
        res.error = "no output streamed"
    return res


async def benchmark(
    base_url: str,
    model: str | None,
    requests: list[dict],
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    api_key: str | None,
    timeout: float = 600.0,
) -> tuple[list[RequestResult], float, str]:
    """Sends every request with Poisson arrivals; returns (results in order, duration s, model)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=max_concurrency or 512)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, limits=limits) as client:
        if model is None:  # ask the server which model it serves
            r = await client.get("/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(req: dict) -> RequestResult:
            if sem is None:
                return await send_request(client, "/v1/completions", model, req, headers)
            async with sem:
                return await send_request(client, "/v1/completions", model, req, headers)

        rng = random.Random(seed)
        tasks = []
        start = time.perf_counter()
        for i, req in enumerate(requests):
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(request_rate) and i < len(requests) - 1:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration, model


# ---- report ------------------------------------------------------------------------------
def _stats_ms(name: str, xs: list[float]) -> dict:
    if not xs:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    s = sorted(xs)
    p99 = s[min(len(s) - 1, max(0, math.ceil(0.99 * len(s)) - 1))]
    return {
        f"mean_{name}_ms": 1000 * statistics.fmean(s),
        f"median_{name}_ms": 1000 * statistics.median(s),
        f"p99_{name}_ms": 1000 * p99,
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    summary |= _stats_ms("ttft", [r.ttft for r in ok])
    summary |= _stats_ms("tpot", tpots)
    summary |= _stats_ms("itl", [x for r in ok for x in r.itl])
    summary |= _stats_ms("e2el", [r.e2e for r in ok])
    return summary


def markdown_table(s: dict) -> str:
    def f(v: object) -> str:
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    rows = [
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", s["duration_s"]),
        ("Total input tokens", s["total_input_tokens"]),
        ("Total generated tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", s["request_throughput"]),
        ("Output token throughput (tok/s)", s["output_throughput"]),
        ("Total token throughput (tok/s)", s["total_token_throughput"]),
    ]
    lines = ["| metric | value |", "| --- | ---: |"] + [f"| {k} | {f(v)} |" for k, v in rows]
    lines += ["", "| latency (ms) | mean | median | p99 |", "| --- | ---: | ---: | ---: |"]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        lines.append(f"| {label} | {f(s[f'mean_{key}_ms'])} | {f(s[f'median_{key}_ms'])} | {f(s[f'p99_{key}_ms'])} |")
    return "\n".join(lines)


# ---- CLI ---------------------------------------------------------------------------------
def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None, help="bearer key (default: $PAGEDLLM_API_KEY / $OPENAI_API_KEY)")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrival rate in requests/s (default inf: all at once)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--workload", default="sharegpt", help="sharegpt | alpaca | path to a JSON workload")
    parser.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrival times")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB,
        help="random prompt ids are drawn from [3, vocab) (synthetic workloads)",
    )
    parser.add_argument("--input-len", type=int, default=None, help="fixed prompt length (synthetic workloads)")
    parser.add_argument("--output-len", type=int, default=None, help="fixed output length (synthetic workloads)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument("--result-json", default=None, help="write the results here")


def run(args: argparse.Namespace) -> int:
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}.")
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    requests = load_requests(args)
    results, duration, model = asyncio.run(
        benchmark(
            args.base_url,
            args.model,
            requests,
            args.request_rate,
            args.max_concurrency,
            args.seed,
            api_key,
            args.timeout,
        )
    )
    summary = summarize(results, duration)
    errors = [r.error for r in results if not r.ok]
    print(
        f"\n## bench serve: {model} at {args.base_url}, {args.workload}, {len(requests)} requests, "
        f"rate {args.request_rate}, max concurrency {args.max_concurrency}\n"
    )
    print(markdown_table(summary))
    if errors:
        print(f"\n{len(errors)} request(s) failed; first error: {errors[0]}", file=sys.stderr)
    if args.result_json:
        record = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "backend": "openai-completions",
            "base_url": args.base_url,
            "model": model,
            "workload": args.workload,
            "num_prompts": len(requests),
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
            **summary,
            "errors": errors[:10],
        }
        with open(args.result_json, "w") as fh:
            json.dump(record, fh, indent=1)
    return 0 if summary["completed"] else 1
