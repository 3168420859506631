"""Soak test of `pagedllm serve` (issue 22), run by hand, not in CI.

Starts the server on a model (default: the default model, smollm2-135m-instruct), then keeps
--clients concurrent streaming clients busy for --minutes (closed loop: each sends its next request
as soon as the last ends, so the server runs at its saturation rate). Of the requests, about
--disconnect-frac are good streams the client drops mid-stream and about --bad-frac are bad
requests (wrong types, out-of-range values, surrogates, unknown model, malformed JSON); the rest
are good streams read to [DONE]. Afterwards it checks:

  * no 5xx (nor an error event in a stream) to any good request; every bad request a 4xx;
  * no leaked KV blocks once idle (/stats: num_free_kv_blocks == num_kv_blocks);
  * the server's RSS, sampled every --sample-s, and its slope over the run after the warm-up;

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
    ttft_s: list[float] = field(default_factory=list)
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


async def client_loop(i: int, base_url: str, model: str, args, deadline: float, tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + i)
    # One connection pool per client: a dropped stream closes its connection, as a real client's would.
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300.0)) as c:
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
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
    }
    result = {
        "label": f"{args.minutes:g}-minute run" + (" (a smoke check, not the 30-minute soak)" * (args.minutes < 30)),
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "lock")},
        "duration_s": round(elapsed, 1),
        "server_startup_s": round(startup_s, 1),
        "tally": {k: v for k, v in asdict(tally).items() if k != "ttft_s"},
        "requests_per_s": round((tally.good + tally.disconnects + tally.bad) / elapsed, 2),
        "completion_tokens_per_s": round(tally.completion_tokens / elapsed, 1),
        "ttft_s": {"p50": round(pct(tally.ttft_s, 0.5), 3), "p99": round(pct(tally.ttft_s, 0.99), 3)},
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


def markdown(r: dict) -> str:
    t, rss, kv = r["tally"], r["rss_mib"], r["kv_blocks"]
    a = r["args"]
    lines = [
        f"# Soak: {r['label']}",
        "",
        f"`python3 benchmarks/soak/soak.py --minutes {a['minutes']:g}` on `{a['model']}`: {a['clients']} concurrent "
        f"streaming clients (closed loop, the server's saturation rate), ~{a['disconnect_frac']:.0%} dropped "
        f"mid-stream, ~{a['bad_frac']:.0%} bad requests; good requests ask for "
        f"{a['max_tokens'] // 4}..{a['max_tokens']} tokens.",
        "",
        f"**{'PASSED' if r['passed'] else 'FAILED'}** in {r['duration_s']:.0f} s of load "
        f"(server start {r['server_startup_s']:.0f} s).",
        "",
        "| check | result |",
        "|---|---|",
        *(f"| {k} | {'ok' if v else '**FAILED**'} |" for k, v in r["checks"].items()),
        "",
        "| measure | value |",
        "|---|---|",
        f"| good streams completed | {t['good_ok']} / {t['good']} |",
        f"| good requests answered 5xx / stream error events | {t['good_5xx']} / {t['good_stream_errors']} |",
        f"| good requests, other status / transport errors | {t['good_other_status'] or 0} / "
        f"{t['good_transport_errors']} |",
        f"| streams dropped mid-stream by the client | {t['disconnects']} |",
        f"| bad requests: 4xx / 5xx | {t['bad_4xx']} / {t['bad_5xx']} of {t['bad']} |",
        f"| requests/s (all kinds) | {r['requests_per_s']} |",
        f"| completion tokens/s (completed streams) | {r['completion_tokens_per_s']} |",
        f"| time to first token p50 / p99 | {r['ttft_s']['p50']} s / {r['ttft_s']['p99']} s |",
        f"| KV blocks leaked once idle | {kv['leaked']} of {kv['total']} |",
        f"| server RSS start / max / end | {rss['start']} / {rss['max']} / {rss['end']} MiB |",
        f"| RSS slope after the first {rss['warmup_s']:.0f} s | {rss['slope_mib_per_min_after_warmup']} MiB/min |",
    ]
    if t["examples"]:
        lines += ["", "First failures:", "", *(f"- `{e}`" for e in t["examples"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
