"""The report of ``pagedllm bench sharing``: ``results.json``, ``README.md`` (markdown tables)
and ``sharing.png``, from the result dict that pagedllm.bench.sharing.run builds."""

from __future__ import annotations

import json
import os

from pagedllm.bench.report import md_table, save_fig
from pagedllm.bench.report.plots import _plt

# The paper's reported range of memory saved (Fig. 15, over its datasets and settings).
PAPER_SAVING = {"parallel sampling": "6-30%", "beam search": "37-66%"}


def write_report(result: dict, out_dir: str) -> list[str]:
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
                ax.bar(labels, [100 * r["saving"] for r in rows], color=color, label=f"{kind} (paper {lo}-{hi}%)")
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
                        r["req_s"] for r in result["prefix"] if r["prefix_len"] == n and r["prefix_caching"] == caching
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
