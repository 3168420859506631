"""Markdown tables and matplotlib plots (Agg backend: no display needed) for benchmark results.

Generic helpers (``md_table``, ``save_fig``) plus the writers of ``pagedllm bench compare``'s three
modes. Each writer takes the mode's result dict (with full per-step ``samples``) and an output
folder, writes ``<mode>.md`` and PNGs, and returns the paths it wrote.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

# Fixed colours so a layout looks the same in every plot.
LAYOUT_COLORS = {"paged": "tab:green", "max": "tab:red", "pow2": "tab:orange", "oracle": "tab:blue"}
LAYOUT_LABELS = {
    "paged": "paged (vLLM)",
    "max": "contiguous max (Orca Max)",
    "pow2": "contiguous pow2 (Orca Pow2)",
    "oracle": "contiguous oracle (Orca Oracle)",
}
# Figure 2 categories: (result key, label, colour)
MEMORY_PARTS = [
    ("token_states", "token states", "tab:green"),
    ("future", "reserved for future tokens", "tab:olive"),
    ("internal_frag", "internal fragmentation", "tab:red"),
    ("external_frag", "external fragmentation", "tab:purple"),
    ("free", "free (no fragmentation)", "lightgrey"),
]


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


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_fig(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


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


# ---- compare ---------------------------------------------------------------------------------


def write_compare(result: dict, out_dir: str) -> list[str]:
    layouts: dict[str, dict] = result["layouts"]
    names = list(layouts)
    files = []
    plt = _plt()

    # KV memory over time, one stacked area per layout (fractions of the whole cache).
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.3 * len(names)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        s = layouts[name]["samples"]
        total = s[0]["total"]
        t = [x["t"] - x["dt"] for x in s]  # a sample describes its step, from the step's start
        parts = [
            [x["used"] / total for x in s],
            [(x["reserved"] - x["used"]) / total for x in s],
            [x["unusable_free"] / total for x in s],
            [(x["free"] - x["unusable_free"]) / total for x in s],
        ]
        ax.stackplot(
            t,
            *parts,
            step="post",
            colors=["tab:green", "tab:orange", "tab:purple", "lightgrey"],
            labels=[
                "used (token states)",
                "reserved, not holding tokens",
                "free but unusable (external frag.)",
                "free",
            ],
        )
        ax.set_ylim(0, 1)
        ax.set_ylabel("KV fraction")
        ax.set_title(LAYOUT_LABELS.get(name, name), fontsize=10)
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=2)
    axes[-1, 0].set_xlabel("engine time (s)")
    files.append(save_fig(fig, os.path.join(out_dir, "compare_kv_memory.png")))

    # Running batch size over time.
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for name in names:
        s = layouts[name]["samples"]
        ax.step(
            [x["t"] - x["dt"] for x in s],
            [x["running"] for x in s],
            where="post",
            color=LAYOUT_COLORS.get(name),
            label=LAYOUT_LABELS.get(name, name),
        )
    ax.set_xlabel("engine time (s)")
    ax.set_ylabel("running requests")
    ax.legend(fontsize=8)
    files.append(save_fig(fig, os.path.join(out_dir, "compare_batch_size.png")))

    # Throughput and latency.
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    colors = [LAYOUT_COLORS.get(n) for n in names]
    x = range(len(names))
    vals = [layouts[n]["output_tok_s"] for n in names]
    axes[0].bar([i - 0.2 for i in x], vals, 0.4, color=colors)
    sat = [layouts[n].get("saturated_output_tok_s") or 0.0 for n in names]
    axes[0].bar([i + 0.2 for i in x], sat, 0.4, color=colors, alpha=0.5, hatch="//")
    axes[0].set_xticks(list(x), names)
    axes[0].set_title("output tok/s: whole run, while requests wait (hatched)", fontsize=9)
    for i, v in enumerate(vals):
        axes[0].text(i - 0.2, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    vals = [layouts[n]["req_s"] for n in names]
    axes[1].bar(names, vals, color=colors)
    axes[1].set_title("requests/s")
    for i, v in enumerate(vals):
        axes[1].text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    axes[2].bar(
        [i - 0.2 for i in x], [layouts[n]["latency_mean_s"] for n in names], 0.4, label="mean", color=colors
    )
    axes[2].bar(
        [i + 0.2 for i in x],
        [layouts[n]["latency_p99_s"] for n in names],
        0.4,
        label="p99",
        color=colors,
        alpha=0.5,
        hatch="//",
    )
    axes[2].set_xticks(list(x), names)
    axes[2].set_title("request latency (s): mean, p99 (hatched)")
    files.append(save_fig(fig, os.path.join(out_dir, "compare_throughput_latency.png")))

    # The paper's Figure 2: where KV memory goes, time-averaged over the saturated phase.
    fig, ax = plt.subplots(figsize=(8, 4))
    bottoms = [0.0] * len(names)
    for key, label, color in MEMORY_PARTS:
        vals = [100 * ((layouts[n]["memory_saturated"] or layouts[n]["memory"])[key]) for n in names]
        ax.bar(names, vals, bottom=bottoms, color=color, label=label)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    for i, n in enumerate(names):
        mem = layouts[n]["memory_saturated"] or layouts[n]["memory"]
        ts = 100 * mem["token_states"]
        ax.text(i, ts / 2, f"{ts:.1f}%", ha="center", fontsize=9)
        paper = result.get("paper_token_states", {}).get(n)
        if paper is not None:
            ax.plot([i - 0.4, i + 0.4], [100 * paper] * 2, "k--", lw=1)
    ax.plot([], [], "k--", lw=1, label="paper: token states")
    ax.set_ylabel("% of KV cache (time-averaged while requests wait)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set_title("KV memory usage (cf. PagedAttention paper, Fig. 2)")
    files.append(save_fig(fig, os.path.join(out_dir, "compare_utilization.png")))

    # Markdown.
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
    files.append(path)
    return files


# ---- block sizes -----------------------------------------------------------------------------


def write_block_sizes(result: dict, out_dir: str) -> list[str]:
    runs = result["block_sizes"]
    sizes = [int(k) for k in runs]
    rs = [runs[str(b)] for b in sizes]
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.5))
    axes[0].plot(sizes, [100 * r["memory"]["waste"] for r in rs], "o-", label="whole run")
    sat = [r["memory_saturated"] for r in rs]
    if all(m is not None for m in sat):
        axes[0].plot(sizes, [100 * m["waste"] for m in sat], "s--", label="while requests wait")
    axes[0].set_title("KV waste: 1 - used/reserved (%)")
    axes[0].legend(fontsize=8)
    axes[1].plot(sizes, [r["output_tok_s"] for r in rs], "o-")
    axes[1].set_title("output tokens/s")
    axes[2].plot(sizes, [r["max_running"] for r in rs], "o-", label="max")
    axes[2].plot(sizes, [r["mean_running"] for r in rs], "s--", label="mean")
    axes[2].set_title("running requests")
    axes[2].legend(fontsize=8)
    axes[3].plot(sizes, [r["mean_step_ms"] for r in rs], "o-", label="whole step")
    if all("attention_ms_per_step" in r for r in rs):
        axes[3].plot(sizes, [r["attention_ms_per_step"] for r in rs], "s--", label="attention")
    axes[3].set_title("ms per step")
    axes[3].legend(fontsize=8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size")
    files = [save_fig(fig, os.path.join(out_dir, "block_sizes.png"))]

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
    files.append(path)
    return files


# ---- batch size 1 ----------------------------------------------------------------------------


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
