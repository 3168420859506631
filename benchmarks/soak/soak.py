"""Soak test of `pagedllm serve` (issue 22), run by hand, not in CI.

Starts the server on a model (default: the default model, smollm2-135m-instruct), then keeps
--clients concurrent streaming clients busy for --minutes (closed loop: each sends its next request
as soon as the last ends, so the server runs at its saturation rate). Of the requests, about
--disconnect-frac are good streams the client drops mid-stream and about --bad-frac are bad
requests (wrong types, out-of-range values, surrogates, unknown model, malformed JSON); the rest
are good streams read to [DONE]; about --costly-frac are the amplification review's request classes
(costly_requests.py), each checked against its contract. Afterwards it checks:

  * no 5xx (nor an error event in a stream) to any good request; every bad request a 4xx;
  * no leaked KV blocks once idle (/stats: num_free_kv_blocks == num_kv_blocks);
  * the server's RSS, sampled every --sample-s, and its slope over the run after the warm-up;
  * with --baseline (a run without bad or costly requests), the p99 latency of completed good
    streams within 2x of that run's;

and writes JSON + markdown to benchmarks/results/soak/ (named after the duration). Exit status 1
when a check fails.

The timed part holds /tmp/pagedllm-bench.lock itself (flock; --lock to change), so the machine's
other benchmark and test runs do not share the CPU with it:

    python3 benchmarks/soak/soak.py                 # 30 minutes
    python3 benchmarks/soak/soak.py --minutes 2     # smoke check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
from costly_requests import pick as pick_costly
from costly_requests import send as send_costly
from soak_report import markdown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPICS = [
    "the history of paged memory in operating systems",
    "why the sky is blue",
    "how a hash table works",
    "a short story about a lighthouse keeper",
    "the rules of chess, briefly",
    "what a compiler does",
    "three tips for learning a language",
    "how bread rises",
]
# Each is a 4xx by contract (tests/test_server_bad_input.py); the soak checks it stays so under load.
BAD_BODIES: list[tuple[str, bytes]] = [
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": "2"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "top_p": 1e39}).encode()),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hi", "model": "no-such-model"}).encode()),
    ("/v1/completions", json.dumps({"prompt": [[]], "stream": True}).encode()),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": '),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": ["s"] * 100}).encode()),
]


@dataclass
class Tally:
    good: int = 0
    good_ok: int = 0
    good_5xx: int = 0
    good_other_status: dict[str, int] = field(default_factory=dict)
    good_stream_errors: int = 0
    good_transport_errors: int = 0
    disconnects: int = 0
    disconnect_5xx: int = 0
    bad: int = 0
    bad_4xx: int = 0
    bad_5xx: int = 0
    bad_other_status: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0
    costly: dict[str, int] = field(default_factory=dict)  # the amplification classes sent, by name
    costly_unexpected: int = 0  # answered other than their contract (a 5xx, a cut stream, ...)
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)  # completed good streams, end to end
    examples: list[str] = field(default_factory=list)  # the first few failures, for the report

    def note(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what[:300])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute."""
    n = len(samples)
    if n < 2:
        return float("nan")
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 60 * sum((t - mt) * (v - mv) for t, v in samples) / var if var else float("nan")


def good_body(rng: random.Random, model: str, max_tokens: int) -> tuple[str, dict]:
    topic = rng.choice(TOPICS)
    common = {
        "model": model,
        "stream": True,
        "max_tokens": rng.randint(max_tokens // 4, max_tokens),
        "stream_options": {"include_usage": True},  # the last chunk counts the tokens
    }
    if rng.random() < 0.5:
        common["temperature"] = rng.choice([0.0, 0.7, 1.0])
    if rng.random() < 0.75:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}
    return "/v1/completions", {**common, "prompt": f"Here is a paragraph about {topic}:"}


async def good_stream(c: httpx.AsyncClient, path: str, body: dict, tally: Tally, drop_after: int | None) -> None:
    t0 = time.monotonic()
    first = True
    chunks = 0
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            if drop_after is not None:
                tally.disconnect_5xx += r.status_code >= 500
            elif r.status_code >= 500:
                tally.good_5xx += 1
                tally.note(f"good {path} -> {r.status_code}: {r.text}")
            else:
                k = str(r.status_code)
                tally.good_other_status[k] = tally.good_other_status.get(k, 0) + 1
                tally.note(f"good {path} -> {r.status_code}: {r.text}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                tally.good_stream_errors += drop_after is None
                tally.note(f"stream error on {path}: {data}")
                return
            if first:
                tally.ttft_s.append(time.monotonic() - t0)
                first = False
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                tally.disconnects += 1
                return  # leaving the context closes the connection mid-stream
            if event.get("usage"):
                tally.completion_tokens += event["usage"]["completion_tokens"]
    if drop_after is None:
        tally.good_ok += 1
        tally.latency_s.append(time.monotonic() - t0)


async def client_loop(i: int, base_url: str, model: str, args, deadline: float, tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + i)
    # One connection pool per client: a dropped stream closes its connection, as a real client's would.
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300.0)) as c:
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
                if roll >= 1 - args.costly_frac:
                    kind = pick_costly(rng)
                    tally.costly[kind.name] = tally.costly.get(kind.name, 0) + 1
                    try:
                        what = await send_costly(c, kind, rng, model)
                    except httpx.TransportError as e:
                        what = f"{kind.name}: transport error: {type(e).__name__}: {e}"
                    if what is not None:
                        tally.costly_unexpected += 1
                        tally.note(what)
                    continue
                if roll < args.bad_frac:
                    tally.bad += 1
                    path, raw = rng.choice(BAD_BODIES)
                    r = await c.post(path, content=raw, headers={"content-type": "application/json"})
                    if 400 <= r.status_code < 500:
                        tally.bad_4xx += 1
                    else:
                        tally.bad_5xx += r.status_code >= 500
                        k = str(r.status_code)
                        tally.bad_other_status[k] = tally.bad_other_status.get(k, 0) + 1
                        tally.note(f"bad {path} {raw[:80]!r} -> {r.status_code}: {r.text}")
                    continue
                path, body = good_body(rng, model, args.max_tokens)
                if roll < args.bad_frac + args.disconnect_frac:
                    await good_stream(c, path, body, tally, drop_after=rng.randint(1, 8))
                else:
                    tally.good += 1
                    await good_stream(c, path, body, tally, drop_after=None)
            except (httpx.TransportError, json.JSONDecodeError) as e:
                tally.good_transport_errors += 1
                tally.note(f"transport error: {type(e).__name__}: {e}")


async def sampler(pid: int, base_url: str, t0: float, stop: asyncio.Event, every: float, out: list[dict]) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c:
        while not stop.is_set():
            row: dict = {"t_s": round(time.monotonic() - t0, 1), "rss_mib": round(rss_mib(pid), 1)}
            with contextlib.suppress(httpx.HTTPError):
                s = (await c.get("/stats")).json()
                row.update({k: s[k] for k in ("num_requests_running", "num_requests_waiting", "num_free_kv_blocks")})
            out.append(row)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every)


async def run_load(pid: int, base_url: str, model: str, args) -> tuple[Tally, list[dict], float]:
    tally = Tally()
    samples: list[dict] = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    sampling = asyncio.create_task(sampler(pid, base_url, t0, stop, args.sample_s, samples))
    await asyncio.gather(*(client_loop(i, base_url, model, args, deadline, tally) for i in range(args.clients)))
    elapsed = time.monotonic() - t0
    stop.set()
    await sampling
    return tally, samples, elapsed


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def wait_idle(base_url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = httpx.get(base_url + "/stats", timeout=10).json()
        if (s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def machine() -> dict:
    """The CPU the soak ran on (results of one machine kind are not compared with another's)."""
    from pagedllm.kernels.build import cpu_flags, cpu_model

    isa = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")))
    return {"cpu": cpu_model(), "isa_flags": isa, "cores": os.cpu_count()}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--disconnect-frac", type=float, default=0.10)
    p.add_argument("--bad-frac", type=float, default=0.05)
    p.add_argument("--costly-frac", type=float, default=0.0, help="amplification requests (costly_requests.py)")
    p.add_argument("--grammar-cache-mb", type=float, default=None, help="the server's PAGEDLLM_GRAMMAR_CACHE_MB")
    p.add_argument("--max-rss-slope", type=float, default=0.2, help="MiB/min after the warm-up (a check)")
    p.add_argument("--baseline", default=None, help="a soak result without bad requests: p99 latency within 2x")
    p.add_argument("--max-tokens", type=int, default=128, help="good requests ask for max_tokens/4 .. this")
    p.add_argument("--sample-s", type=float, default=5.0, help="RSS and /stats sampling period")
    p.add_argument("--warmup-frac", type=float, default=0.2, help="leading part of the run left out of the RSS slope")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lock", default="/tmp/pagedllm-bench.lock", help="flock held for the timed part ('' for none)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "soak"))
    p.add_argument("--name", default=None, help="result file name (default: soak_<minutes>min)")
    p.add_argument("serve_args", nargs="*", help="extra `pagedllm serve` arguments (after --)")
    args = p.parse_args(argv)

    lock_fh = None
    if args.lock:
        lock_fh = open(args.lock, "a")  # held until the server is stopped
        print(f"waiting for {args.lock} ...", flush=True)
        fcntl.flock(lock_fh, fcntl.LOCK_EX)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    os.makedirs(args.out, exist_ok=True)
    name = args.name or f"soak_{args.minutes:g}min"
    log_path = os.path.join(args.out, f"{name}.server.log")
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", args.model, "--port", str(port)]
    cmd += ["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *args.serve_args]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.grammar_cache_mb is not None:
        env["PAGEDLLM_GRAMMAR_CACHE_MB"] = str(args.grammar_cache_mb)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        t_start = time.monotonic()
        wait_healthy(base_url, proc)
        startup_s = time.monotonic() - t_start
        model = httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        print(f"server up in {startup_s:.0f}s; {args.clients} clients for {args.minutes:g} min ...", flush=True)
        tally, samples, elapsed = asyncio.run(run_load(proc.pid, base_url, model, args))
        idle = wait_idle(base_url)
        health = httpx.get(base_url + "/health", timeout=10).status_code
        rss_end = rss_mib(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if lock_fh is not None:
            lock_fh.close()

    warm = [(r["t_s"], r["rss_mib"]) for r in samples if r["t_s"] >= args.warmup_frac * elapsed]
    leaked = idle["num_kv_blocks"] - idle["num_free_kv_blocks"]
    checks = {
        "no_5xx_to_good_requests": tally.good_5xx == 0 and tally.good_stream_errors == 0,
        "good_requests_all_completed": tally.good_ok == tally.good,
        "bad_requests_all_4xx": tally.bad_4xx == tally.bad,
        "no_leaked_kv_blocks": leaked == 0,
        "no_step_errors": idle.get("num_step_errors", 0) == 0,
        "healthy_afterwards": health == 200,
        "costly_requests_as_contracted": tally.costly_unexpected == 0,
        "rss_slope_after_warmup_within_bound": slope_per_min(warm) <= args.max_rss_slope,
    }
    if args.baseline:
        with open(args.baseline) as f:
            base = json.load(f)
        checks["good_p99_latency_within_2x_of_baseline"] = pct(tally.latency_s, 0.99) <= 2 * base["latency_s"]["p99"]
    result = {
        "label": f"{args.minutes:g}-minute run"
        + (" (a baseline: no bad or costly requests)" if args.bad_frac == 0 == args.costly_frac else "")
        + (
            " (a smoke check, not a 30-minute soak)"
            if args.minutes < 30 and (args.bad_frac or args.costly_frac)
            else ""
        ),
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "lock")},
        "command": " ".join(["python3 benchmarks/soak/soak.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine(),
        "duration_s": round(elapsed, 1),
        "server_startup_s": round(startup_s, 1),
        "tally": {k: v for k, v in asdict(tally).items() if k not in ("ttft_s", "latency_s")},
        "requests_per_s": round((tally.good + tally.disconnects + tally.bad) / elapsed, 2),
        "completion_tokens_per_s": round(tally.completion_tokens / elapsed, 1),
        "ttft_s": {"p50": round(pct(tally.ttft_s, 0.5), 3), "p99": round(pct(tally.ttft_s, 0.99), 3)},
        "latency_s": {"p50": round(pct(tally.latency_s, 0.5), 3), "p99": round(pct(tally.latency_s, 0.99), 3)},
        "baseline": args.baseline and os.path.basename(args.baseline),
        "kv_blocks": {"total": idle["num_kv_blocks"], "free_when_idle": idle["num_free_kv_blocks"], "leaked": leaked},
        "stats_when_idle": idle,
        "rss_mib": {
            "start": samples[0]["rss_mib"] if samples else None,
            "max": max((r["rss_mib"] for r in samples), default=None),
            "end": round(rss_end, 1),
            "slope_mib_per_min_after_warmup": round(slope_per_min(warm), 3),
            "warmup_s": round(args.warmup_frac * elapsed, 1),
        },
        "checks": checks,
        "passed": all(checks.values()),
        "samples": samples,
    }
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(markdown(result))
    print(markdown(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
