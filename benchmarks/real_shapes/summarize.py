"""Markdown table of run_baseline.sh's raw results: llama.cpp vs pagedllm, batch size 1.

    python3 summarize.py /tmp/real-shapes/raw [RESULTS_DIR]

With RESULTS_DIR (benchmarks/results/real_shapes): also writes results.json and results.md there.

Reads OUT/llamacpp/{Q}-pg150_128.json, {Q}-pp512.json, {Q}-tg128.json (llama-bench -o json) and
OUT/latency/results.jsonl (pagedllm bench latency; the last line of each label wins).

Columns: ms/token = wall of (prefill 150 + 128 generated tokens) / 128, prefill included, for both
engines (llama.cpp: median of the pg150,128 test's 3 samples_ns; pagedllm: ms_per_output_token);
llama.cpp tg128 ms/token: pure decode, median sample / 128; prefill tok/s of a 512-token prompt
(llama.cpp: 512 / median pp512 sample; pagedllm: 512 / median wall of a 512-in / 1-out
request); ratio = pagedllm / llama.cpp for ms/token, llama.cpp / pagedllm for prefill (both > 1
mean pagedllm is slower).
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


def rows(out: str) -> list[dict]:
    """One row per file: both engines' figures and the ratios (None where a run is missing)."""
    paged: dict[str, dict] = {}
    lat = os.path.join(out, "latency", "results.jsonl")
    if os.path.exists(lat):
        with open(lat) as fh:
            for line in fh:
                if line.strip():
                    r = json.loads(line)
                    paged[r["label"]] = r
    order = ["Q4_K_M", "Q4_0", "Q8_0"]
    quants = sorted(
        {f.split("-")[0] for f in os.listdir(os.path.join(out, "llamacpp")) if f.endswith(".json")},
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
        out_rows.append(
            {
                "file": q,
                "llamacpp_ms_per_token_pg150_128": l_ms,
                "llamacpp_tg128_ms_per_token": l_tg,
                "llamacpp_prefill512_tok_s": l_pp,
                "pagedllm_ms_per_token_150_128": p_ms,
                "pagedllm_prefill512_tok_s": p_pp,
                "ratio_ms_per_token_paged_over_llama": p_ms / l_ms if (p_ms and l_ms) else None,
                "ratio_prefill_llama_over_paged": l_pp / p_pp if (l_pp and p_pp) else None,
            }
        )
    return out_rows


def table(rs: list[dict]) -> str:
    def f(x, d=1):
        return "-" if x is None else f"{x:.{d}f}"

    lines = [
        "| file | llama.cpp ms/token pg150,128 | llama.cpp tg128 ms/token | llama.cpp prefill 512 tok/s | "
        "pagedllm ms/token 150/128 | pagedllm prefill 512 tok/s | ratio ms/token (paged/llama) | "
        "ratio prefill (llama/paged) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rs:
        v = list(r.values())
        lines.append(
            f"| {v[0]} | {f(v[1])} | {f(v[2])} | {f(v[3])} | {f(v[4])} | {f(v[5])} | {f(v[6], 2)} | {f(v[7], 2)} |"
        )
    return "\n".join(lines)


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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/real-shapes/raw", (sys.argv[2:] or [None])[0]))
