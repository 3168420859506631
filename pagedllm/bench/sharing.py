"""`pagedllm bench sharing`: KV memory saved by sharing blocks, and throughput with prefix caching.

Two measurements, after the vLLM paper's Fig. 15 and Fig. 16:

memory   ShareGPT-like requests (``--workload``, output lengths capped at ``--max-output``) run with
         parallel sampling (``n`` in ``--n-values``, temperature 1, seeded) and with beam search
         (width in ``--beam-widths``, ignore_eos so every beam runs its full length). After every
         engine step the KV manager reports the blocks its block tables reference: *physical*
         (a shared block once) and *logical* (once per sequence holding it: what the same
         sequences would hold without sharing). Memory saving = 1 - sum(physical) / sum(logical)
         over the steps of the run (time-averaged, as the paper's "blocks saved by sharing / blocks
         without sharing"), plus the saving at the step of peak logical usage. The cache is large
         enough that nothing is preempted, so both counts describe the same trajectory; prefix
         caching is off so only forks share.
prefix   a shared prefix of ``--prefix-lens`` tokens (default 80 and 341: the paper's 1-shot and
         5-shot translation prompts) + a per-request suffix of 16..48 tokens, ``--prefix-output``
         tokens out, ``--prefix-requests`` requests submitted at once; run with
         ``enable_prefix_caching`` off and on (same engine settings otherwise). Reports the wall
         time of generation (median of ``--repeats``), throughput, and the prefix-cache hit rate
         (cached blocks / looked-up blocks) and the fraction of prompt tokens served from it.

Writes ``results.json``, ``README.md`` and ``sharing.png`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from pagedllm.bench.sharing_report import PAPER_SAVING, write_report
from pagedllm.bench.sharing_runs import prefix_workload, run_memory, run_prefix
from pagedllm.bench.workloads import add_workload_args, workload_from_args, workload_summary
from pagedllm.entrypoints.engine_args import add_engine_args, engine_kwargs

__all__ = ["PAPER_SAVING", "add_args", "prefix_workload", "run", "run_memory", "run_prefix", "write_report"]

DEFAULT_OUT_DIR = "benchmarks/results/sharing"


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, default_num_prompts=20)
    add_engine_args(p, skip=("seed",))
    p.add_argument("--n-values", default="2,4,8", help="parallel sampling n values (comma-separated)")
    p.add_argument("--beam-widths", default="2,4,6", help="beam widths (comma-separated)")
    p.add_argument("--max-output", type=int, default=128, help="cap on each request's output length (memory part)")
    p.add_argument("--prefix-lens", default="80,341", help="shared prefix lengths (1-shot, 5-shot)")
    p.add_argument("--prefix-requests", type=int, default=48, help="requests per prefix run")
    p.add_argument("--prefix-output", type=int, default=32, help="output tokens per prefix-run request")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each prefix configuration (median)")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-prefix", action="store_true")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    p.add_argument("--no-save", action="store_true", help="print only, write no files")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM

    kwargs = engine_kwargs(args, skip=("model", "seed"))
    result: dict = {
        "bench": "sharing",
        "model": args.model,
        "engine": kwargs,
        "command": "pagedllm bench sharing " + " ".join(sys.argv[sys.argv.index("sharing") + 1 :])
        if "sharing" in sys.argv
        else "pagedllm bench sharing",
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "max_output": args.max_output,
        "prefix_requests": args.prefix_requests,
        "prefix_output": args.prefix_output,
        "repeats": args.repeats,
        "paper_saving": PAPER_SAVING,
    }
    if not args.skip_memory:
        llm = LLM(model=args.model, **{**kwargs, "enable_prefix_caching": False})
        result["dtype"] = str(llm.llm_engine.dtype).removeprefix("torch.")
        requests = workload_from_args(args, vocab_size=llm.llm_engine.vocab_size)
        summary = workload_summary(requests)
        summary["output_tokens_capped"] = sum(min(r["max_tokens"], args.max_output) for r in requests)
        result["workload"] = {"name": args.workload, "seed": args.seed, **summary}
        result["memory"] = run_memory(llm, requests, _ints(args.n_values), _ints(args.beam_widths), args.max_output)
        del llm
    if not args.skip_prefix:
        rows = run_prefix(
            args.model,
            kwargs,
            _ints(args.prefix_lens),
            args.prefix_requests,
            args.prefix_output,
            args.repeats,
        )
        for r in rows:
            base = next(b for b in rows if b["prefix_len"] == r["prefix_len"] and not b["prefix_caching"])
            r["speedup"] = round(base["wall_s"] / r["wall_s"], 3)
        result["prefix"] = rows
        result.setdefault("dtype", kwargs.get("dtype"))
    print("RESULT " + json.dumps(result, sort_keys=True))
    if not args.no_save:
        for p in write_report(result, args.out_dir):
            print(f"wrote {p}", file=sys.stderr)
    return 0
