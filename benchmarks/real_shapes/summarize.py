"""Tables and a plot of run_baseline.sh's raw results: llama.cpp vs pagedllm, same run.

    python3 summarize.py /tmp/real-shapes/raw [RESULTS_DIR]

With RESULTS_DIR: also writes results.json, results.md and results.png there.

Reads OUT/llamacpp/{Q}-pg150_128.json, {Q}-pp512.json, {Q}-tg128.json (llama-bench -o json),
OUT/latency/results.jsonl and OUT/batched/results.jsonl (pagedllm bench; the last line of each
label wins), OUT/batched/{Q}-llama-batched-bench.jsonl, OUT/bandwidth.json, OUT/{Q}-weight-bytes.json.

Columns: ms/token = wall of (prefill 150 + 128 generated tokens) / 128, prefill included, for both
engines (llama.cpp: median of the pg150,128 test's 3 samples_ns; pagedllm: ms_per_output_token);
prefill tok/s of a 512-token prompt (llama.cpp: 512 / median pp512 sample; pagedllm: 512 / median
wall of a 512-in / 1-out request); decode alone (llama.cpp: tg128 median / 128; pagedllm: (16 in /
129 out - 16 in / 1 out) / 128, medians of 3); the bandwidth floor = weight bytes a decode step
reads / measured read GB/s; batched: total tok/s (prompt + output) of 32 x (150 + 128). Every
ratio is written so that the issue's bar reads off it directly (named in the header).
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def llama(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        txt = fh.read().strip()
    if not txt:
        return None
    rows = json.loads(txt)
    return rows[0] if rows else None


def med_ns(row: dict) -> float:
    """Median of llama-bench's repetitions (its avg_ns is a mean: one disturbed run moves it)."""
    return statistics.median(row["samples_ns"])


def read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def paged_results(out: str) -> dict[str, dict]:
    """pagedllm's bench results by label (the last line of each label wins)."""
    paged: dict[str, dict] = {}
    for sub in ("latency", "batched"):
        path = os.path.join(out, sub, "results.jsonl")
        if os.path.exists(path):
            with open(path) as fh:
                for line in fh:
                    if line.strip():
                        r = json.loads(line)
                        paged[r["label"]] = r
    return paged


def llama_batched_tok_s(out: str, q: str) -> float | None:
    """llama-batched-bench's total speed (S t/s: prompt + generated tokens / total time)."""
    path = os.path.join(out, "batched", f"{q}-llama-batched-bench.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        lines = [json.loads(x) for x in fh if x.strip().startswith("{")]
    return lines[-1]["speed"] if lines else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if (a and b) else None


def rows(out: str) -> list[dict]:
    """One row per file: both engines' figures and the ratios (None where a run is missing)."""
    paged = paged_results(out)
    bandwidth = read_json(os.path.join(out, "bandwidth.json"))
    order = ["Q4_K_M", "Q4_0", "Q8_0"]
    names = os.listdir(os.path.join(out, "llamacpp"))
    if os.path.isdir(os.path.join(out, "batched")):  # a batched-only run has no llama-bench files
        names += [f for f in os.listdir(os.path.join(out, "batched")) if f.endswith("-llama-batched-bench.jsonl")]
    quants = sorted(
        {f.split("-")[0] for f in names if f.endswith((".json", ".jsonl"))},
        key=lambda q: order.index(q) if q in order else len(order),
    )
    out_rows = []
    for q in quants:
        pg = llama(os.path.join(out, "llamacpp", f"{q}-pg150_128.json"))
        pp = llama(os.path.join(out, "llamacpp", f"{q}-pp512.json"))
        tg = llama(os.path.join(out, "llamacpp", f"{q}-tg128.json"))
        l_ms = med_ns(pg) / 1e6 / pg["n_gen"] if pg else None
        l_tg = med_ns(tg) / 1e6 / tg["n_gen"] if tg else None
        l_pp = pp["n_prompt"] / (med_ns(pp) / 1e9) if pp else None
        pd = paged.get(f"pagedllm {q} pg150,128")
        pp_p = paged.get(f"pagedllm {q} pp512")
        p_ms = pd["ms_per_output_token"] if pd else None
        p_pp = None
        if pp_p:
            w = pp_p["workload"]
            p_pp = w["prompt_len"]["mean"] * w["num_requests"] / pp_p["wall_s"]
        d_long, d_short = paged.get(f"pagedllm {q} decode16+129"), paged.get(f"pagedllm {q} decode16+1")
        p_tg = (d_long["wall_s"] - d_short["wall_s"]) * 1e3 / 128 if (d_long and d_short) else None
        b = paged.get(f"pagedllm {q} batched32")
        p_b = None
        if b:
            w = b["workload"]
            p_b = (w["prompt_len"]["mean"] + w["output_len"]["mean"]) * w["num_requests"] / b["wall_s"]
        l_b = llama_batched_tok_s(out, q)
        wb = read_json(os.path.join(out, f"{q}-weight-bytes.json"))
        floor = wb["bytes_per_token"] / (bandwidth["read_gb_s"] * 1e9) * 1e3 if (wb and bandwidth) else None
        out_rows.append(
            {
                "file": q,
                "llamacpp_ms_per_token_pg150_128": l_ms,
                "pagedllm_ms_per_token_150_128": p_ms,
                "ratio_ms_per_token_paged_over_llama": ratio(p_ms, l_ms),
                "llamacpp_prefill512_tok_s": l_pp,
                "pagedllm_prefill512_tok_s": p_pp,
                "ratio_prefill_paged_over_llama": ratio(p_pp, l_pp),
                "llamacpp_tg128_ms_per_token": l_tg,
                "pagedllm_decode_ms_per_token": p_tg,
                "bandwidth_floor_ms_per_token": floor,
                "pagedllm_decode_over_floor": ratio(p_tg, floor),
                "llamacpp_batched32_total_tok_s": l_b,
                "pagedllm_batched32_total_tok_s": p_b,
                "ratio_batched_paged_over_llama": ratio(p_b, l_b),
                "weight_bytes_per_token": wb["bytes_per_token"] if wb else None,
                "read_gb_s": bandwidth["read_gb_s"] if bandwidth else None,
            }
        )
    return out_rows


COLUMNS = [  # (key, header, decimals)
    ("file", "file", None),
    ("llamacpp_ms_per_token_pg150_128", "llama.cpp ms/token pg150,128", 1),
    ("pagedllm_ms_per_token_150_128", "pagedllm ms/token 150/128", 1),
    ("ratio_ms_per_token_paged_over_llama", "ms/token paged/llama (bar <= 0.9)", 2),
    ("llamacpp_prefill512_tok_s", "llama.cpp prefill 512 tok/s", 1),
    ("pagedllm_prefill512_tok_s", "pagedllm prefill 512 tok/s", 1),
    ("ratio_prefill_paged_over_llama", "prefill paged/llama (bar >= 1.5)", 2),
    ("llamacpp_tg128_ms_per_token", "llama.cpp decode ms/token (tg128)", 1),
    ("pagedllm_decode_ms_per_token", "pagedllm decode ms/token", 1),
    ("bandwidth_floor_ms_per_token", "floor ms/token (bytes / read GB/s)", 1),
    ("pagedllm_decode_over_floor", "pagedllm decode / floor (bar <= 1.15)", 2),
    ("llamacpp_batched32_total_tok_s", "llama.cpp 32 x (150+128) tok/s", 1),
    ("pagedllm_batched32_total_tok_s", "pagedllm 32 x (150+128) tok/s", 1),
    ("ratio_batched_paged_over_llama", "batched paged/llama (bar >= 2)", 2),
]


def table(rs: list[dict]) -> str:
    def f(x, d):
        return "-" if x is None else (str(x) if d is None else f"{x:.{d}f}")

    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rs:
        lines.append("| " + " | ".join(f(r[k], d) for k, _, d in COLUMNS) + " |")
    return "\n".join(lines)


def plot(rs: list[dict], machine: str, path: str) -> None:
    """Each ratio per file, pagedllm over llama.cpp oriented so that above 1 is pagedllm ahead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        (
            "batch 1 150+128 (llama ms / paged ms)",
            lambda r: ratio(r["llamacpp_ms_per_token_pg150_128"], r["pagedllm_ms_per_token_150_128"]),
        ),
        ("prefill 512", lambda r: r["ratio_prefill_paged_over_llama"]),
        ("decode alone", lambda r: ratio(r["llamacpp_tg128_ms_per_token"], r["pagedllm_decode_ms_per_token"])),
        ("32 x (150+128)", lambda r: r["ratio_batched_paged_over_llama"]),
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(metrics)
    for i, (name, fn) in enumerate(metrics):
        xs = [j + i * width for j in range(len(rs))]
        ax.bar(xs, [fn(r) or 0 for r in rs], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rs))], [r["file"] for r in rs])
    ax.set_ylabel("pagedllm speed / llama.cpp speed")
    ax.set_title((machine.splitlines() or [""])[0].replace("Model name:", "").strip(), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(out: str, results_dir: str | None = None) -> int:
    machine = ""
    if os.path.exists(os.path.join(out, "machine.txt")):
        with open(os.path.join(out, "machine.txt")) as fh:
            machine = fh.read()
    rs = rows(out)
    print(machine)
    print(table(rs))
    if results_dir:
        os.makedirs(results_dir, exist_ok=True)
        with open(os.path.join(results_dir, "results.json"), "w") as fh:
            json.dump({"machine": machine.strip().splitlines(), "rows": rs}, fh, indent=2)
        with open(os.path.join(results_dir, "results.md"), "w") as fh:
            fh.write("```\n" + machine.strip() + "\n```\n\n" + table(rs) + "\n")
        plot(rs, machine, os.path.join(results_dir, "results.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/real-shapes/raw", (sys.argv[2:] or [None])[0]))
