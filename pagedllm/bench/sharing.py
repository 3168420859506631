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
import random
import statistics
import sys
import time

from pagedllm.bench.workloads import add_workload_args, workload_from_args, workload_summary
from pagedllm.entrypoints.engine_args import add_engine_args, engine_kwargs

DEFAULT_OUT_DIR = "benchmarks/results/sharing"
# The paper's reported range of memory saved (Fig. 15, over its datasets and settings).
PAPER_SAVING = {"parallel sampling": "6-30%", "beam search": "37-66%"}


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, default_num_prompts=20)
    add_engine_args(p, skip=("seed",))
    p.add_argument("--n-values", default="2,4,8", help="parallel sampling n values (comma-separated)")
    p.add_argument("--beam-widths", default="2,4,6", help="beam widths (comma-separated)")
    p.add_argument(
        "--max-output", type=int, default=128, help="cap on each request's output length (memory part)"
    )
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


# ---- memory ----------------------------------------------------------------------------------
def _drive(engine, add) -> dict:
    """Adds the requests (``add(engine)``), steps to the end, sampling KV block counts per step."""
    kv = engine.kv_manager
    add(engine)
    phys = logi = peak_logical = peak_phys_at = steps = 0
    t = time.perf_counter()
    preempt0 = engine.scheduler.num_preemptions
    while engine.has_unfinished_requests():
        engine.step()
        st = kv.stats()
        p, lg = st.reserved // kv.block_size, st.logical_blocks
        phys += p
        logi += lg
        steps += 1
        if lg > peak_logical:
            peak_logical, peak_phys_at = lg, p
    return {
        "steps": steps,
        "wall_s": round(time.perf_counter() - t, 2),
        "sum_physical_blocks": phys,
        "sum_logical_blocks": logi,
        "saving": round(1 - phys / logi, 4) if logi else 0.0,
        "peak_logical_blocks": peak_logical,
        "physical_blocks_at_peak": peak_phys_at,
        "saving_at_peak": round(1 - peak_phys_at / peak_logical, 4) if peak_logical else 0.0,
        "num_preemptions": engine.scheduler.num_preemptions - preempt0,
    }


def run_memory(
    llm, requests: list[dict], n_values: list[int], widths: list[int], max_output: int
) -> list[dict]:
    from pagedllm import BeamSearchParams, SamplingParams

    rows = []
    for n in n_values:

        def add(engine, n=n):
            for i, r in enumerate(requests):
                engine.add_request(
                    None,
                    {"prompt_token_ids": r["prompt_token_ids"]},
                    SamplingParams(
                        n=n,
                        temperature=1.0,
                        seed=i,
                        max_tokens=min(r["max_tokens"], max_output),
                        ignore_eos=True,
                        detokenize=False,
                    ),
                )

        res = _drive(llm.llm_engine, add)
        rows.append({"kind": "parallel sampling", "param": n, **res})
        print(f"parallel sampling n={n}: saving {res['saving']:.1%} ({res['wall_s']} s)", file=sys.stderr)
    for w in widths:

        def add(engine, w=w):
            for r in requests:
                engine.add_beam_search_request(
                    None,
                    {"prompt_token_ids": r["prompt_token_ids"]},
                    BeamSearchParams(
                        beam_width=w, max_tokens=min(r["max_tokens"], max_output), ignore_eos=True
                    ),
                )

        res = _drive(llm.llm_engine, add)
        rows.append({"kind": "beam search", "param": w, **res})
        print(f"beam search width={w}: saving {res['saving']:.1%} ({res['wall_s']} s)", file=sys.stderr)
    return rows


# ---- prefix caching --------------------------------------------------------------------------
def prefix_workload(prefix_len: int, num: int, output: int, vocab_size: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(prefix_len)]
    return [
        {
            "prompt_token_ids": prefix + [rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 48))],
            "max_tokens": output,
        }
        for _ in range(num)
    ]


def _timed_run(llm, requests: list[dict]) -> dict:
    from pagedllm import SamplingParams

    kv = llm.llm_engine.kv_manager
    q0, h0 = kv.prefix_cache_stats()
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
        for r in requests
    ]
    t = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests], params, use_tqdm=False
    )
    wall = time.perf_counter() - t
    q, h = kv.prefix_cache_stats()
    return {
        "wall_s": wall,
        "queries": q - q0,
        "hits": h - h0,
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
    }


def run_prefix(
    model: str, kwargs: dict, prefix_lens: list[int], num: int, output: int, repeats: int
) -> list[dict]:
    from pagedllm import LLM

    rows = []
    for caching in (False, True):
        llm = LLM(model=model, **{**kwargs, "enable_prefix_caching": caching})
        vocab = llm.llm_engine.vocab_size
        _timed_run(llm, prefix_workload(16, 4, 4, vocab, seed=99))  # warm-up: kernels, allocator
        for plen in prefix_lens:
            reqs = prefix_workload(plen, num, output, vocab)
            runs = []
            for _ in range(repeats):
                # Each timed run starts from a cold prefix cache: the first request computes the prefix.
                if caching:
                    llm.llm_engine.kv_manager.pool.reset_prefix_cache()
                runs.append(_timed_run(llm, reqs))
            wall = statistics.median(r["wall_s"] for r in runs)
            last = runs[-1]
            prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
            out_tokens = num * output
            rows.append(
                {
                    "prefix_len": plen,
                    "prefix_caching": caching,
                    "num_requests": num,
                    "walls_s": [round(r["wall_s"], 3) for r in runs],
                    "wall_s": round(wall, 3),
                    "req_s": round(num / wall, 3),
                    "output_tok_s": round(out_tokens / wall, 1),
                    "total_tok_s": round((prompt_tokens + out_tokens) / wall, 1),
                    "prompt_tokens": prompt_tokens,
                    "hit_rate": round(last["hits"] / last["queries"], 4) if last["queries"] else 0.0,
                    "cached_prompt_fraction": round(last["cached_tokens"] / prompt_tokens, 4),
                }
            )
            print(f"prefix {plen} caching={caching}: {num / wall:.2f} req/s", file=sys.stderr)
        del llm
    return rows


# ---- report ----------------------------------------------------------------------------------
def write_report(result: dict, out_dir: str) -> list[str]:
    from pagedllm.bench.report import _plt, md_table, save_fig

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1, sort_keys=True)
    paths.append(path)

    lines = [
        "# KV block sharing: memory saved, and prefix caching throughput",
        "",
        f"Command: `flock /tmp/pagedllm-bench.lock {result['command']}` (the lock keeps other benchmarks "
        "off the CPUs; other work on the machine was not stopped).",
        "",
        f"Model {result['model']} ({result['dtype']}), block_size {result['engine'].get('block_size')}, "
        f"{result['cpu_count']} CPUs ({result['host']}), {result['time']}.",
        "",
    ]
    if result.get("memory"):
        w = result["workload"]
        lines += [
            "## Memory saved by sharing (paper Fig. 15)",
            "",
            f"Workload: {w['name']} (seed {w['seed']}), {w['num_requests']} requests, prompt tokens "
            f"{w['prompt_tokens_total']} (median {w['prompt_len']['median']}), outputs capped at "
            f"{result['max_output']} tokens ({w['output_tokens_capped']} output tokens per sequence, "
            "summed over the requests; n / width sequences each). Saving = 1 - sum(physical blocks) / "
            "sum(logical blocks) over all engine steps; logical counts a shared block once per sequence "
            "holding it (the same sequences without sharing). Preemptions: "
            f"{sum(r['num_preemptions'] for r in result['memory'])}.",
            "",
            "What is shared is the prompt (parallel sampling) or the common history of the beams (beam "
            "search), so the saving grows with n / width and with the prompt's share of a sequence: a "
            "request of prompt P and output O sampled n ways saves (n-1)P / n(P+t) of its blocks after t "
            "output tokens (50% at t=0 for n=2, falling as the outputs grow). The paper's ShareGPT trace "
            "has outputs about twice its prompts; here outputs are capped, so prompts are a larger share "
            "and parallel sampling saves more than the paper's range. Wall times are in results.json "
            "(indicative only: the machine was shared).",
            "",
            md_table(
                [
                    "kind",
                    "n / width",
                    "saving (time avg)",
                    "saving at peak",
                    "peak logical blocks",
                    "physical at peak",
                    "steps",
                    "paper",
                ],
                [
                    [
                        r["kind"],
                        r["param"],
                        f"{100 * r['saving']:.1f}%",
                        f"{100 * r['saving_at_peak']:.1f}%",
                        r["peak_logical_blocks"],
                        r["physical_blocks_at_peak"],
                        r["steps"],
                        PAPER_SAVING[r["kind"]],
                    ]
                    for r in result["memory"]
                ],
            ),
            "",
        ]
    if result.get("prefix"):
        lines += [
            "## Prefix caching on a shared-prefix workload (paper Fig. 16)",
            "",
            f"{result['prefix_requests']} requests at once, each a shared prefix + a 16-48 token suffix, "
            f"{result['prefix_output']} output tokens (greedy, ignore_eos); median of {result['repeats']} "
            "runs, each from a cold prefix cache. (The paper's Fig. 16 compares vLLM with Orca (Oracle), "
            "not with itself without prefix sharing: 1.67x for 1-shot, 3.58x for 5-shot.)",
            "",
            md_table(
                [
                    "prefix tokens",
                    "prefix caching",
                    "wall s",
                    "req/s",
                    "output tok/s",
                    "total tok/s",
                    "block hit rate",
                    "prompt tokens cached",
                    "speed-up",
                ],
                [
                    [
                        r["prefix_len"],
                        "on" if r["prefix_caching"] else "off",
                        r["wall_s"],
                        r["req_s"],
                        r["output_tok_s"],
                        r["total_tok_s"],
                        f"{100 * r['hit_rate']:.1f}%",
                        f"{100 * r['cached_prompt_fraction']:.1f}%",
                        f"{r.get('speedup', 1.0):.2f}x",
                    ]
                    for r in result["prefix"]
                ],
            ),
            "",
        ]
    lines += ["Raw numbers: `results.json`; plot: `sharing.png`."]
    path = os.path.join(out_dir, "README.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    paths.append(path)

    plt = _plt()
    panels = int(bool(result.get("memory"))) + int(bool(result.get("prefix")))
    if panels:
        fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
        ax_i = 0
        if result.get("memory"):
            ax = axes[0][ax_i]
            ax_i += 1
            for kind, color, lo, hi in (
                ("parallel sampling", "tab:blue", 6, 30),
                ("beam search", "tab:green", 37, 66),
            ):
                rows = [r for r in result["memory"] if r["kind"] == kind]
                labels = [f"{'n' if kind == 'parallel sampling' else 'w'}={r['param']}" for r in rows]
                ax.bar(
                    labels, [100 * r["saving"] for r in rows], color=color, label=f"{kind} (paper {lo}-{hi}%)"
                )
            ax.set_ylabel("KV memory saved by sharing (%)")
            ax.set_title("Blocks saved: 1 - physical / logical")
            ax.legend(fontsize=8)
        if result.get("prefix"):
            ax = axes[0][ax_i]
            lens = sorted({r["prefix_len"] for r in result["prefix"]})
            x = range(len(lens))
            for k, (caching, color) in enumerate(((False, "tab:red"), (True, "tab:green"))):
                vals = [
                    next(
                        r["req_s"]
                        for r in result["prefix"]
                        if r["prefix_len"] == n and r["prefix_caching"] == caching
                    )
                    for n in lens
                ]
                ax.bar(
                    [i + 0.4 * k for i in x],
                    vals,
                    width=0.4,
                    color=color,
                    label=f"prefix caching {'on' if caching else 'off'}",
                )
            ax.set_xticks([i + 0.2 for i in x], [f"{n}-token prefix" for n in lens])
            ax.set_ylabel("requests / s")
            ax.set_title("Shared-prefix workload")
            ax.legend(fontsize=8)
        paths.append(save_fig(fig, os.path.join(out_dir, "sharing.png")))
    return paths


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
        result["memory"] = run_memory(
            llm, requests, _ints(args.n_values), _ints(args.beam_widths), args.max_output
        )
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
