"""`pagedllm bench throughput`: offline throughput on a workload, as vLLM's `bench throughput`.

All requests are submitted at once (token-id prompts, greedy, ignore_eos, each its own
max_tokens) and the engine runs until all finish. The wall time covers generation only (model
load, kernel build and a small warm-up are excluded), median of --repeats runs on one engine.
Also reports two rooflines, both measured in the same process:
- GEMM: the weight matmuls of a token cost 2 x (parameter count) FLOP, at the FLOP/s of a large
  bf16/fp32 matmul;
- memory: the bytes decoding must read at least — every decode step reads every running
  sequence's whole K/V in every layer, and all the weights once — at the read bandwidth of a
  large sequential sum. On a small CPU this, not the GEMM roofline, is what bounds decode.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time

from pagedllm.bench.workloads import add_workload_args, workload_from_args, workload_summary
from pagedllm.entrypoints.engine_args import add_engine_args, engine_kwargs
from pagedllm.runner.kv_cache import kv_bytes_per_block

DEFAULT_OUT_DIR = "benchmarks/results/throughput"


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_engine_args(p, skip=("seed",))
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--label", default=None, help="name of this configuration in the results")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    p.add_argument("--no-save", action="store_true", help="print only, write no files")


def gemm_peak_gflops(dtype, n: int = 2048, iters: int = 10) -> float:
    """FLOP/s of a large square matmul in this process: the roofline the model's GEMMs can reach."""
    import torch

    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    return 2 * n**3 * iters / (time.perf_counter() - t) / 1e9


def read_bandwidth_gbs(mib: int = 1024, iters: int = 3) -> float:
    """GB/s of a large sequential read (a float sum over ``mib`` MiB) in this process, best of ``iters``.
    Larger than the last-level cache (480 MiB on the 2-core VMs here: 512 MiB read 27 GB/s, 1 GiB 22)."""
    import torch

    x = torch.ones(mib << 18)  # float32: mib MiB
    x.sum()
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def decode_kv_read_bytes(requests: list[dict], kv_bytes_per_token: int) -> int:
    """K/V bytes the decode steps of a workload read: the step producing output token i + 1 of a
    request (i = 1 .. max_tokens - 1; token 1 comes from its prefill) attends over prompt + i tokens."""
    total_tokens = 0
    for r in requests:
        p, o = len(r["prompt_token_ids"]), r["max_tokens"]
        total_tokens += (o - 1) * p + (o - 1) * o // 2
    return total_tokens * kv_bytes_per_token


def common_result(
    bench: str, label: str, args: argparse.Namespace, engine, kwargs: dict, summary: dict, walls: list[float]
) -> dict:
    """Fields every offline pagedllm benchmark result carries (median wall of the timed runs)."""
    wall = statistics.median(walls)
    n_out = summary["output_tokens_total"]
    return {
        "bench": bench,
        "label": label,
        "model": args.model,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "engine": kwargs,
        "workload": {"name": args.workload, "seed": args.seed, **summary},
        "walls_s": [round(w, 3) for w in walls],
        "wall_s": round(wall, 3),
        "ms_per_output_token": round(1000 * wall / n_out, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def run_requests(llm, requests: list[dict]) -> float:
    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False) for r in requests
    ]
    # Every timed run starts from a cold prefix cache, as a fresh process (vLLM's bench) does:
    # a repeat of the same workload would otherwise skip most of its prefill.
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    want = sum(r["max_tokens"] for r in requests)
    if got != want:
        raise RuntimeError(f"generated {got} tokens, expected {want}")
    return wall


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedllm import LLM

    kwargs = engine_kwargs(args, skip=("model", "seed"))
    llm = LLM(model=args.model, **kwargs)
    engine = llm.llm_engine
    requests = workload_from_args(args, vocab_size=engine.vocab_size)
    run_requests(llm, [{"prompt_token_ids": r["prompt_token_ids"][:32], "max_tokens": 8} for r in requests[:4]])
    steps_before = engine.stats_counters["steps"]
    walls = [run_requests(llm, requests) for _ in range(args.repeats)]
    steps = (engine.stats_counters["steps"] - steps_before) / args.repeats
    wall = statistics.median(walls)
    summary = workload_summary(requests)
    n_prompt, n_out = summary["prompt_tokens_total"], summary["output_tokens_total"]
    # Peak RSS of the runs themselves: taken before the roofline probes allocate their buffers.
    common = common_result(
        "throughput",
        args.label or f"pagedllm {args.kv_layout} bs{args.block_size}",
        args,
        engine,
        kwargs,
        summary,
        walls,
    )
    params = engine.model.num_params
    peak = gemm_peak_gflops(engine.dtype)
    gemm_s = (n_prompt + n_out) * 2 * params / (peak * 1e9)
    model = engine.model
    kv_per_token = kv_bytes_per_block(len(model.layers), 1, model.num_kv_heads, model.head_dim, engine.kv_dtype)
    kv_bytes = decode_kv_read_bytes(requests, kv_per_token)
    # One pass over the weights per step (a tied embedding is read once, as the LM head).
    weight_bytes = params * torch.empty((), dtype=engine.dtype).element_size()
    read_gbs = read_bandwidth_gbs()
    memory_s = (kv_bytes + steps * weight_bytes) / (read_gbs * 1e9)
    result = {
        **common,
        "output_tok_s": round(n_out / wall, 2),
        "total_tok_s": round((n_prompt + n_out) / wall, 2),
        "req_s": round(len(requests) / wall, 4),
        "model_params": params,
        "gemm_peak_gflops": round(peak, 1),
        "gemm_roofline_s": round(gemm_s, 2),
        "roofline_fraction": round(gemm_s / wall, 3),
        "read_bandwidth_gbs": round(read_gbs, 1),
        "decode_kv_read_bytes": kv_bytes,
        "weight_read_bytes": round(steps * weight_bytes),
        "engine_steps": steps,
        "memory_roofline_s": round(memory_s, 2),
        "memory_roofline_fraction": round(memory_s / wall, 3),
        "num_preemptions": engine.scheduler.num_preemptions,
        "kv_cache_tokens": engine.num_kv_blocks * engine.config.block_size,
        # what one token of context costs in the KV cache: the number that decides how many
        # sequences fit, and so how large a batch the scheduler can run
        "kv_bytes_per_token": kv_per_token,
        "architecture": ",".join(getattr(engine.hf_config, "architectures", None) or [type(model).__name__]),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    print("RESULT " + json.dumps(result, sort_keys=True))
    row = (
        f"| {result['label']} | {result['dtype']} | {len(requests)} | {wall:.1f} | {result['output_tok_s']:.1f} "
        f"| {result['total_tok_s']:.1f} | {result['ms_per_output_token']:.2f} | {result['roofline_fraction']:.0%} "
        f"| {result['memory_roofline_fraction']:.0%} | {result['peak_rss_mib']:.0f} |"
    )
    print(
        "| system | dtype | requests | wall s | output tok/s | total tok/s | ms/out tok | GEMM roofline "
        "| memory roofline | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(row)
    if not args.no_save:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "results.jsonl"), "a") as fh:
            fh.write(json.dumps(result, sort_keys=True) + "\n")
    return 0
