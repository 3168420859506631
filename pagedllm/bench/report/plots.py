"""Matplotlib plots (Agg backend: no display needed) of ``pagedllm bench compare``'s modes.

Each ``plot_<mode>`` takes the mode's result dict (with full per-step ``samples``) and an output
folder, writes the mode's PNGs there and returns their paths.
"""

from __future__ import annotations

import os

from pagedllm.bench.report.tables import LAYOUT_LABELS

# Fixed colours so a layout looks the same in every plot.
LAYOUT_COLORS = {"paged": "tab:green", "max": "tab:red", "pow2": "tab:orange", "oracle": "tab:blue"}
# Figure 2 categories: (result key, label, colour)
MEMORY_PARTS = [
    ("token_states", "token states", "tab:green"),
    ("future", "reserved for future tokens", "tab:olive"),
    ("internal_frag", "internal fragmentation", "tab:red"),
    ("external_frag", "external fragmentation", "tab:purple"),
    ("free", "free (no fragmentation)", "lightgrey"),
]


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


def plot_compare(result: dict, out_dir: str) -> list[str]:
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
    axes[2].bar([i - 0.2 for i in x], [layouts[n]["latency_mean_s"] for n in names], 0.4, label="mean", color=colors)
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
    return files


def plot_block_sizes(result: dict, out_dir: str) -> list[str]:
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
    return files
