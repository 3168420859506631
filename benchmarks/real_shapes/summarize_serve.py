"""Table and plot of run_serve.sh's raw results: pagedllm serve vs llama-server, same client, same run.

    python3 summarize_serve.py /tmp/real-shapes/serve [RESULTS_DIR]

Reads OUT/pagedllm.json and OUT/llama-server.json (`vllm bench serve --save-result`),
OUT/machine.txt and OUT/pagedllm-stats-after.json. With RESULTS_DIR: writes serve.json,
serve.md and serve.png there. The bar of the issue: pagedllm's output tok/s >= 2x
llama-server's, 0 failed requests.
"""

from __future__ import annotations

import json
import os
import sys

SERVERS = ("pagedllm", "llama-server")
METRICS = (
    ("completed", "completed", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    ("output_throughput", "output tok/s", "{:.1f}"),
    ("total_token_throughput", "total tok/s", "{:.1f}"),
    ("mean_ttft_ms", "TTFT mean ms", "{:.0f}"),
    ("p99_ttft_ms", "TTFT p99 ms", "{:.0f}"),
    ("mean_tpot_ms", "TPOT mean ms", "{:.0f}"),
    ("p99_tpot_ms", "TPOT p99 ms", "{:.0f}"),
    ("mean_e2el_ms", "E2E mean ms", "{:.0f}"),
)


def load(out: str) -> dict[str, dict]:
    runs = {}
    for name in SERVERS:
        path = os.path.join(out, f"{name}.json")
        if os.path.exists(path):
            with open(path) as fh:
                runs[name] = json.load(fh)
    return runs


def read_text(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as fh:
        return fh.read()


def failed(r: dict) -> int:
    return int(r["failed"])  # vllm bench serve's own count


def table(runs: dict[str, dict]) -> str:
    lines = ["| server | " + " | ".join(label for _, label, _ in METRICS) + " |", "|---" * (len(METRICS) + 1) + "|"]
    for name, r in runs.items():
        cells = []
        for key, _, fmt in METRICS:
            v = failed(r) if key == "failed" else r.get(key)
            cells.append("-" if v is None else fmt.format(v))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    out = argv[0]
    runs = load(out)
    text = table(runs)
    ratio = None
    if len(runs) == 2:
        ratio = runs["pagedllm"]["output_throughput"] / runs["llama-server"]["output_throughput"]
        text += f"\n\npagedllm / llama-server output tok/s: **{ratio:.2f}x** (bar >= 2x, 0 failed)\n"
    print(text)
    if len(argv) > 1:
        res = argv[1]
        os.makedirs(res, exist_ok=True)
        machine = read_text(os.path.join(out, "machine.txt"))
        stats_text = read_text(os.path.join(out, "pagedllm-stats-after.json"))
        stats = json.loads(stats_text) if stats_text else None
        keep = [k for k, _, _ in METRICS if k != "failed"] + ["num_prompts", "max_concurrency", "duration"]
        summary = {
            "machine": machine,
            "ratio_output_tok_s": ratio,
            "runs": {n: {k: r.get(k) for k in keep} | {"failed": failed(r)} for n, r in runs.items()},
            "pagedllm_stats_after": stats,
        }
        with open(os.path.join(res, "serve.json"), "w") as fh:
            json.dump(summary, fh, indent=2)
        with open(os.path.join(res, "serve.md"), "w") as fh:
            fh.write("# pagedllm serve vs llama-server, `vllm bench serve` (run_serve.sh)\n\n")
            fh.write("```\n" + machine + "```\n\n")
            fh.write(text + "\n")
        plot(runs, os.path.join(res, "serve.png"))
    return 0


def plot(runs: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = list(runs)
    axes[0].bar(names, [runs[n]["output_throughput"] for n in names], color=["#3d7ae0", "#999999"][: len(names)])
    axes[0].set_title("output tok/s (higher is better)")
    axes[1].bar(names, [runs[n]["mean_tpot_ms"] for n in names], color=["#3d7ae0", "#999999"][: len(names)])
    axes[1].set_title("TPOT mean ms (lower is better)")
    fig.suptitle("vllm bench serve: random 150 / 128, 64 concurrent")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
