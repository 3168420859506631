"""Data parallelism through the real server: DP=2 vs DP=1 throughput, prefix routing vs round robin.

Every configuration is one `pagedllm serve` subprocess on a random-weight Llama the script builds
(width 512, 8 layers, 8 query / 4 KV heads, the tests' 512-token BPE tokenizer; float32), loaded
with an offered load of all requests at once (non-streamed /v1/completions, token-id prompts,
greedy, ``ignore_eos``: the work is fixed by the workload). Output tok/s = completion tokens /
wall time of the batch; the median of ``--repeats`` batches after one warm-up batch.

1. throughput: DP=1 (one engine, ``--num-threads`` = all CPUs) against DP=2 (two replicas, the
   CPUs split between them), random prompts that share nothing;
2. shared prefix: 8 system prompts of several KV blocks, each followed by a short unique suffix,
   shuffled; DP=2 with ``--data-parallel-routing prefix`` against ``round_robin``: the prefix
   cache hit rate (the replicas' prefix_cache_hits / prefix_cache_queries over the batch) and
   throughput. Each repeat draws new system prompts, so no batch finds the last one's in cache.

    python3 benchmarks/results/parallel/bench_data_parallel.py

writes data_parallel.json and data_parallel.md beside this script; the timed part holds
``flock /tmp/pagedllm-bench.lock`` (one timed run at a time on a small machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from bench_lock import bench_lock  # this folder: the script's own directory is on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SIZE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=2048,
)
BLOCK = 16  # the engine's default KV block size
VOCAB = 512  # the tests' tokenizer


def build_model(out_dir: str) -> str:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from tiny_models import build_model as build_tiny

    return build_tiny("llama", out_dir, config_overrides=SIZE)


class Server:
    """`pagedllm serve` in a subprocess (it starts and stops its own Ray cluster when DP > 1)."""

    def __init__(self, model: str, port: int, log: str, *flags: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port)]
        cmd += ["--dtype", "float32", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *flags]
        self.cmd = cmd
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy: see {log}")

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=60).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


async def run_batch(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """All requests at once; (wall seconds, completion tokens)."""
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(p: list[int]) -> int:
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t0, sum(tokens)


def random_prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


def shared_prefix_prompts(rng: random.Random, args: argparse.Namespace) -> list[list[int]]:
    systems = random_prompts(rng, args.num_systems, args.system_blocks * BLOCK)
    prompts = [
        s + [rng.randrange(3, VOCAB) for _ in range(args.suffix_len)] for s in systems for _ in range(args.per_system)
    ]
    rng.shuffle(prompts)  # the systems' requests interleave
    return prompts


def prefix_counters(stats: dict) -> tuple[int, int, int]:
    """(prefix cache hits, queries, tokens the model ran: the steps' token counts), summed over the
    live replicas. Cached prompt tokens are not run, so the last falls as the cache hits more."""
    replicas = stats.get("replicas") or [stats]
    alive = [r for r in replicas if r.get("alive", True)]
    ran = sum(int(n) * c for r in alive for n, c in (r.get("iteration_tokens") or {}).items())
    return sum(r["prefix_cache_hits"] for r in alive), sum(r["prefix_cache_queries"] for r in alive), ran


def measure(server: Server, batches: list[list[list[int]]], max_tokens: int) -> dict:
    """First batch warms up; the rest are timed. Tok/s, and the prefix hit rate of each batch."""
    asyncio.run(run_batch(server.url, batches[0], max_tokens))
    runs = []
    for prompts in batches[1:]:
        hits0, queries0, computed0 = prefix_counters(server.stats())
        wall, tokens = asyncio.run(run_batch(server.url, prompts, max_tokens))
        hits1, queries1, computed1 = prefix_counters(server.stats())
        runs.append(
            {
                "wall_s": round(wall, 3),
                "output_tokens": tokens,
                "output_tok_s": round(tokens / wall, 2),
                "prefix_hit_rate": round((hits1 - hits0) / max(queries1 - queries0, 1), 4),
                # tokens the replicas ran through the model: prefill not cached + decode
                "tokens_run": computed1 - computed0,
                "prompt_tokens_offered": sum(map(len, prompts)),
            }
        )
    stats = server.stats()
    routed = [r.get("router_requests_routed") for r in stats.get("replicas", [])]
    return {
        "output_tok_s_median": statistics.median(r["output_tok_s"] for r in runs),
        "prefix_hit_rate_median": statistics.median(r["prefix_hit_rate"] for r in runs),
        "tokens_run_median": statistics.median(r["tokens_run"] for r in runs),
        "prompt_tokens_offered": runs[0]["prompt_tokens_offered"],
        "requests_routed_per_replica": routed,
        "runs": runs,
    }


def markdown(result: dict, command: str) -> str:
    a = result["args"]
    t, s = result["throughput"], result["shared_prefix"]
    dp1, dp2 = t["dp1"]["output_tok_s_median"], t["dp2"]["output_tok_s_median"]
    pre, rr = s["prefix"], s["round_robin"]
    lines = [
        "# Data parallel: DP=2 vs DP=1, prefix routing vs round robin",
        "",
        f"Random-weight Llama (width {SIZE['hidden_size']}, {SIZE['num_hidden_layers']} layers, "
        f"{SIZE['num_attention_heads']}/{SIZE['num_key_value_heads']} heads, vocabulary {VOCAB}, float32) "
        f"behind `pagedllm serve`, {result['cpus']} CPUs. Offered load: every request of a batch at once "
        "(non-streamed completions, greedy, ignore_eos). Medians of "
        f"{a['repeats']} batches after a warm-up batch; all numbers from one run of:",
        "",
        f"    {command}",
        "",
        f"## Throughput ({a['num_requests']} requests, {a['prompt_len']}-token prompts, {a['output_len']} tokens out)",
        "",
        "| configuration | output tok/s (median) | runs |",
        "|---|---|---|",
        f"| DP=1, one engine, {t['dp1']['threads']} threads | {dp1:.1f} | "
        + ", ".join(f"{r['output_tok_s']:.1f}" for r in t["dp1"]["runs"])
        + " |",
        f"| DP=2, two replicas, {t['dp2']['threads']} thread(s) each | {dp2:.1f} | "
        + ", ".join(f"{r['output_tok_s']:.1f}" for r in t["dp2"]["runs"])
        + " |",
        "",
        f"DP=2 / DP=1: **{dp2 / dp1:.2f}x**.",
        "",
        f"## Shared prefix ({a['num_systems']} system prompts of {a['system_blocks']} blocks x "
        f"{a['per_system']} requests, {a['suffix_len']}-token unique suffixes, "
        f"{a['shared_output_len']} tokens out; DP=2)",
        "",
        "| routing | prefix cache hit rate (median) | tokens run (median) / prompt tokens offered "
        "| output tok/s (median) | requests per replica (all batches) |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {x['prefix_hit_rate_median']:.3f} | {x['tokens_run_median']:.0f} / "
            f"{x['prompt_tokens_offered']} | {x['output_tok_s_median']:.1f} | {x['requests_routed_per_replica']} |"
            for name, x in (("prefix", pre), ("round_robin", rr))
        ),
        "",
        f"Prefix / round robin: hit rate "
        f"{pre['prefix_hit_rate_median'] / max(rr['prefix_hit_rate_median'], 1e-9):.2f}x, "
        f"throughput {pre['output_tok_s_median'] / rr['output_tok_s_median']:.2f}x. The hit rate is "
        "prefix_cache_hits / prefix_cache_queries summed over the replicas, over each batch; the pool counts "
        "lookups in blocks and stops at a prompt's first miss, so a miss weighs one lookup and a hit many: the "
        "tokens the replicas ran through the model (uncached prefill + decode, the decode the same for both) "
        "are the plainer measure of the work the cache saved.",
        "",
        "## Reading",
        "",
        result["reading"],
        "",
    ]
    return "\n".join(lines)


def reading(result: dict) -> str:
    t, s = result["throughput"], result["shared_prefix"]
    ratio = t["dp2"]["output_tok_s_median"] / t["dp1"]["output_tok_s_median"]
    pre, rr = s["prefix"]["prefix_hit_rate_median"], s["round_robin"]["prefix_hit_rate_median"]
    pc, rc = s["prefix"]["tokens_run_median"], s["round_robin"]["tokens_run_median"]
    return (
        f"On {result['cpus']} cores, DP=2 gives each replica {t['dp2']['threads']} core(s) where DP=1 gives its one "
        f"engine all {result['cpus']}: the same compute either way, so DP=2 at {ratio:.2f}x DP=1 measures how well "
        "two single-threaded engines (each batching half the requests, plus the Ray hop: one object per output a "
        "replica streams to the front end) use the cores against one engine's intra-op threads. It says nothing "
        "about scaling: that needs replicas with their own cores, memory bandwidth and KV cache (other nodes). "
        f"On the shared-prefix workload prefix routing reached a prefix cache hit rate of {pre:.3f} against "
        f"{rr:.3f} for round robin, and its replicas ran {pc:.0f} tokens through the model against {rc:.0f}: round "
        "robin spreads every system prompt over both replicas, so each replica computes (and caches) every "
        "prefix once; with every request arriving at once, a request that arrives before its prefix's blocks "
        "exist finds nothing to hit under either policy. Throughput follows the prefill saved only as far as "
        "prefill dominates the batch."
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-systems", type=int, default=16)
    p.add_argument("--system-blocks", type=int, default=8)
    p.add_argument("--per-system", type=int, default=4)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--shared-output-len", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=18950)
    p.add_argument("--model-dir", default=None, help="where the random-weight model goes (default: a temp folder)")
    args = p.parse_args()
    cpus = os.cpu_count() or 1
    model = build_model(args.model_dir or os.path.join(tempfile.gettempdir(), "pagedllm-dp-bench-model"))
    logs = tempfile.mkdtemp(prefix="dp-bench-")
    kv = ["--num-kv-blocks", "2048"]
    result: dict = {"args": vars(args), "cpus": cpus, "model": SIZE}
    rng = random.Random(0)
    throughput_batches = [random_prompts(rng, args.num_requests, args.prompt_len) for _ in range(args.repeats + 1)]
    shared_batches = [shared_prefix_prompts(rng, args) for _ in range(args.repeats + 1)]
    configs = [
        ("throughput", "dp1", ["--data-parallel-size", "1", "--num-threads", str(cpus)], cpus),
        ("throughput", "dp2", ["--data-parallel-size", "2", "--num-threads", str(max(1, cpus // 2))], cpus // 2),
        ("shared_prefix", "prefix", ["--data-parallel-size", "2", "--data-parallel-routing", "prefix"], cpus // 2),
        (
            "shared_prefix",
            "round_robin",
            ["--data-parallel-size", "2", "--data-parallel-routing", "round_robin"],
            cpus // 2,
        ),
    ]
    with bench_lock():
        for i, (part, name, flags, threads) in enumerate(configs):
            print(f"{part}/{name}: starting", flush=True)
            server = Server(model, args.port + i, os.path.join(logs, f"{part}-{name}.log"), *kv, *flags)
            try:
                if part == "throughput":
                    r = measure(server, throughput_batches, args.output_len)
                else:
                    r = measure(server, shared_batches, args.shared_output_len)
            finally:
                server.stop()
            r["threads"] = threads
            r["flags"] = flags
            result.setdefault(part, {})[name] = r
            print(
                f"{part}/{name}: {r['output_tok_s_median']} tok/s, hit rate {r['prefix_hit_rate_median']}", flush=True
            )
    result["reading"] = reading(result)
    command = "python3 benchmarks/results/parallel/bench_data_parallel.py " + " ".join(sys.argv[1:])
    with open(os.path.join(HERE, "data_parallel.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(HERE, "data_parallel.md"), "w") as f:
        f.write(markdown(result, command.strip()))
    print(markdown(result, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
