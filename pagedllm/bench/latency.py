"""`pagedllm bench latency`: batch size 1. One request at a time; ms per output token, prefill included.

Matches the anchors' batch-size-1 measurement: the first N requests of a workload, run one after
the other (max_num_seqs=1 is implied by submitting them one by one), wall / useful output tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from pagedllm.bench.throughput import common_result, run_requests
from pagedllm.bench.workloads import add_workload_args, workload_from_args, workload_summary
from pagedllm.entrypoints.engine_args import add_engine_args, engine_kwargs

DEFAULT_OUT_DIR = "benchmarks/results/latency"


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, default_num_prompts=10)
    add_engine_args(p, skip=("seed",))
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the requests; median reported")
    p.add_argument("--label", default=None)
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    p.add_argument("--no-save", action="store_true")


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    kwargs = engine_kwargs(args, skip=("model", "seed"))
    llm = LLM(model=args.model, **kwargs)
    engine = llm.llm_engine
    requests = workload_from_args(args, vocab_size=engine.vocab_size)
    run_requests(llm, [{"prompt_token_ids": requests[0]["prompt_token_ids"][:32], "max_tokens": 8}])
    walls = []
    for _ in range(args.repeats):
        walls.append(sum(run_requests(llm, [r]) for r in requests))
    wall = statistics.median(walls)
    summary = workload_summary(requests)
    n_out = summary["output_tokens_total"]
    result = {
        **common_result("latency", args.label or "pagedllm bs1", args, engine, kwargs, summary, walls),
        "output_tok_s": round(n_out / wall, 2),
    }
    print("RESULT " + json.dumps(result, sort_keys=True))
    print(
        f"| {result['label']} | {result['dtype']} | {len(requests)} | {wall:.1f} s | "
        f"{result['ms_per_output_token']:.2f} ms/token |"
    )
    if not args.no_save:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "results.jsonl"), "a") as fh:
            fh.write(json.dumps(result, sort_keys=True) + "\n")
    return 0
