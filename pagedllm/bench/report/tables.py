"""Markdown tables (and the JSON dump) of benchmark results.

Generic helpers (``md_table``, ``dumps_json``) plus the markdown writers of ``pagedllm bench
compare``'s modes: each takes the mode's result dict and an output folder, writes
``<mode>.md`` and returns its path.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

LAYOUT_LABELS = {
    "paged": "paged (vLLM)",
    "max": "contiguous max (Orca Max)",
    "pow2": "contiguous pow2 (Orca Pow2)",
    "oracle": "contiguous oracle (Orca Oracle)",
}


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(x: object) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def dumps_json(obj: object) -> str:
    """Indented JSON with every list of plain numbers on one line (timelines stay readable and small)."""
    text = json.dumps(obj, indent=1)
    return re.sub(
        r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _config_lines(result: dict) -> list[str]:
    c, w = result["config"], result["workload"]
    return [
        f"- model: `{c['model']}` ({c['dtype']}), max_model_len {c['max_model_len']}, "
        f"max_num_seqs {c['max_num_seqs']}, max_num_batched_tokens {c['max_num_batched_tokens']}, "
        f"threads {c['num_threads'] or 'torch default'}",
        f"- workload: `{w['name']}` seed {w['seed']}: {w['num_requests']} requests, "
        f"{w['prompt_tokens_total']} prompt + {w['output_tokens_total']} output tokens, all arriving at t=0, "
        f"greedy, ignore_eos (each runs to exactly max_tokens)",
        f"- KV budget: {c['num_kv_tokens']} token slots for every layout",
        "- time is engine time: the sum of `step()` durations, less the KV stats sampling done inside "
        "each step (right after scheduling)",
        f"- command wall time: {result.get('command_wall_s', float('nan')):.0f} s",
    ]


def write_compare_md(result: dict, out_dir: str) -> str:
    layouts: dict[str, dict] = result["layouts"]
    names = list(layouts)
    lines = ["# Paged vs contiguous KV reservation", ""] + _config_lines(result) + [""]
    rows = []
    for n in names:
        r = layouts[n]
        sat = r.get("saturated_output_tok_s")
        rows.append(
            [
                LAYOUT_LABELS.get(n, n),
                r["block_size"],
                r["max_running"],
                r["mean_running"],
                r["output_tok_s"],
                r["req_s"],
                "n/a" if sat is None else sat,
                r["latency_mean_s"],
                r["latency_p99_s"],
                r["norm_latency_mean_s_per_tok"],
                r["num_preemptions"],
                r["engine_time_s"],
                r["mean_step_ms"],
            ]
        )
    lines += [
        "## Throughput and latency",
        "",
        md_table(
            [
                "layout",
                "block size",
                "max running",
                "mean running",
                "output tok/s",
                "req/s",
                "output tok/s while requests wait",
                "mean latency s",
                "p99 latency s",
                "mean s/output token per request",
                "preemptions",
                "engine time s",
                "ms/step",
            ],
            rows,
        ),
        "",
    ]
    ratios = result.get("throughput_ratio_paged_over", {})
    if ratios:

        def sat(v: dict) -> str:
            return (
                ""
                if v.get("saturated_output_tok_s") is None
                else f", {v['saturated_output_tok_s']:.2f}x while requests wait"
            )

        lines += [
            "Paged over each baseline (output tok/s over the whole run): "
            + "; ".join(
                f"**{v['output_tok_s']:.2f}x** vs {k} (max concurrency {v['max_running']:.1f}x{sat(v)})"
                for k, v in ratios.items()
            ),
            "",
        ]
    for phase, key, what in (
        ("while requests wait (saturated)", "memory_saturated", "the paper's regime"),
        ("whole run", "memory", "includes the drain at the end"),
    ):
        rows = []
        for n in names:
            m = layouts[n][key]
            if m is None:
                rows.append([LAYOUT_LABELS.get(n, n)] + ["n/a"] * 8)
                continue
            paper = result.get("paper_token_states", {}).get(n)
            rows.append(
                [
                    LAYOUT_LABELS.get(n, n),
                    _pct(m["token_states"]),
                    _pct(paper),
                    _pct(m["future"]),
                    _pct(m["internal_frag"]),
                    _pct(m["external_frag"]),
                    _pct(m["free"]),
                    _pct(m["used_over_reserved"]),
                    f"{m['time_s']:.0f}",
                ]
            )
        lines += [
            f"## KV memory, time-averaged {phase} ({what})",
            "",
            md_table(
                [
                    "layout",
                    "token states",
                    "paper",
                    "reserved for future tokens",
                    "internal frag.",
                    "external frag.",
                    "free",
                    "used / reserved",
                    "seconds averaged",
                ],
                rows,
            ),
            "",
        ]
    lines += [
        "Fractions of the whole KV cache: token states + reserved for future tokens + internal frag. = "
        "reserved; + external frag. + free = 100%. Reserved for future tokens: slots a request will "
        "fill before it ends; internal frag.: reserved slots it never fills (prompt + max_tokens - 1 "
        "is the most a request holds); external frag.: free slots in holes smaller than the "
        "reservation the blocked head of the queue needs, counted when the free slots add up to that "
        "reservation (so only their splitting blocks it); free: the rest (nobody waits for memory, or "
        "the head needs more than is free even in total, as when the paged layout's head waits).",
        "",
        "Requests whose greedy output equals the first layout's: "
        + ", ".join(f"{k} {100 * v:.0f}%" for k, v in result.get("identical_outputs", {}).items())
        + " (fp32 runs match exactly; in bf16 a different batch changes rounding, which can flip "
        "near-ties of the logits).",
        "",
        "Plots: `compare_kv_memory.png`, `compare_batch_size.png`, `compare_throughput_latency.png`, "
        "`compare_utilization.png`.",
    ]
    attn = [(n, layouts[n].get("attention_fraction")) for n in names]
    if all(a is not None for _, a in attn):
        lines += [
            "",
            "Share of engine time in attention (write + read of the KV cache): "
            + ", ".join(f"{n} {100 * a:.0f}%" for n, a in attn)
            + ".",
        ]
    path = os.path.join(out_dir, "compare.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def write_block_sizes_md(result: dict, out_dir: str) -> str:
    runs = result["block_sizes"]
    sizes = [int(k) for k in runs]
    rs = [runs[str(b)] for b in sizes]
    rows = []
    for b, r in zip(sizes, rs, strict=True):
        m, ms = r["memory"], r["memory_saturated"]
        rows.append(
            [
                b,
                r["num_kv_blocks"],
                _pct(m["waste"]),
                _pct(ms["waste"] if ms else None),
                r["max_running"],
                r["mean_running"],
                r["output_tok_s"],
                r["req_s"],
                r["latency_mean_s"],
                r["mean_step_ms"],
                r.get("attention_ms_per_step", "n/a"),
                _pct(r.get("attention_fraction")),
                r["num_preemptions"],
            ]
        )
    lines = (
        ["# Block-size study (paged)", ""]
        + _config_lines(result)
        + [
            "",
            md_table(
                [
                    "block size",
                    "blocks",
                    "waste (whole run)",
                    "waste (while requests wait)",
                    "max running",
                    "mean running",
                    "output tok/s",
                    "req/s",
                    "mean latency s",
                    "ms/step",
                    "attention ms/step",
                    "attention share",
                    "preemptions",
                ],
                rows,
            ),
            "",
            "Attention time: every call of the model's `paged_attention` (KV write + gather + SDPA) timed with "
            "`perf_counter` on the CPU, where calls are synchronous; ms/step is the whole `step()` "
            "(schedule + inputs + model + sampling).",
            "",
            "Plot: `block_sizes.png`.",
        ]
    )
    path = os.path.join(out_dir, "block_sizes.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def write_bs1(result: dict, out_dir: str) -> list[str]:
    rows = []
    for name, r in result["systems"].items():
        secs = r.get("engine_time_s", r.get("wall_s"))
        rows.append([name, r.get("block_size", "-"), r["output_tokens"], secs, r["ms_per_output_token"]])
    lines = (
        ["# Batch size 1: ms per output token", ""]
        + _config_lines(result)
        + [
            "",
            md_table(["system", "block size", "output tokens", "seconds", "ms / output token"], rows),
            "",
            "Engines: max_num_seqs=1, requests run one after another; time includes each prefill. HF: "
            "`AutoModelForCausalLM.generate` (greedy, KV cache, min_new_tokens = max_new_tokens = max_tokens) "
            "on the same checkpoint folder and dtype, one request at a time.",
        ]
    )
    path = os.path.join(out_dir, "bs1.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return [path]
