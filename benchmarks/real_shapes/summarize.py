"""Markdown table of run_baseline.sh's raw results: llama.cpp vs pagedllm, batch size 1.

    python3 summarize.py /tmp/real-shapes/raw

Reads OUT/llamacpp/{Q}-pg150_128.json, {Q}-pp512.json, {Q}-tg128.json (llama-bench -o json) and
OUT/latency/results.jsonl (pagedllm bench latency; the last line of each label wins).

Columns: ms/token = wall of (prefill 150 + 128 generated tokens) / 128, prefill included, for both
engines (llama.cpp: avg_ns of the pg150,128 test; pagedllm: ms_per_output_token); prefill tok/s of
a 512-token prompt (llama.cpp: pp512 avg_ts; pagedllm: 512 / median wall of a 512-in / 1-out
request); ratio = pagedllm / llama.cpp for ms/token, llama.cpp / pagedllm for prefill (both > 1
mean pagedllm is slower).
"""

from __future__ import annotations

import json
import os
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


def main(out: str) -> int:
    paged: dict[str, dict] = {}
    lat = os.path.join(out, "latency", "results.jsonl")
    if os.path.exists(lat):
        with open(lat) as fh:
            for line in fh:
                if line.strip():
                    r = json.loads(line)
                    paged[r["label"]] = r
    quants = sorted(
        {f.split("-")[0] for f in os.listdir(os.path.join(out, "llamacpp")) if f.endswith(".json")},
        key=lambda q: ["Q4_K_M", "Q4_0", "Q8_0"].index(q) if q in ("Q4_K_M", "Q4_0", "Q8_0") else 9,
    )
    if os.path.exists(os.path.join(out, "machine.txt")):
        print(open(os.path.join(out, "machine.txt")).read())
    print(
        "| file | llama.cpp ms/token pg150,128 | llama.cpp tg128 ms/token | llama.cpp prefill 512 tok/s | "
        "pagedllm ms/token 150/128 | pagedllm prefill 512 tok/s | ratio ms/token (paged/llama) | "
        "ratio prefill (llama/paged) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for q in quants:
        pg = llama(os.path.join(out, "llamacpp", f"{q}-pg150_128.json"))
        pp = llama(os.path.join(out, "llamacpp", f"{q}-pp512.json"))
        tg = llama(os.path.join(out, "llamacpp", f"{q}-tg128.json"))
        l_ms = pg["avg_ns"] / 1e6 / pg["n_gen"] if pg else None
        l_tg = 1000.0 / tg["avg_ts"] if tg else None
        l_pp = pp["avg_ts"] if pp else None
        pd = paged.get(f"pagedllm {q} pg150,128")
        pp_p = paged.get(f"pagedllm {q} pp512")
        p_ms = pd["ms_per_output_token"] if pd else None
        p_pp = (pp_p["workload"]["prompt_len"]["mean"] / pp_p["wall_s"] * pp_p["workload"]["num_requests"]) if pp_p else None

        def f(x, d=1):
            return "-" if x is None else f"{x:.{d}f}"

        r1 = p_ms / l_ms if (p_ms and l_ms) else None
        r2 = l_pp / p_pp if (l_pp and p_pp) else None
        print(f"| {q} | {f(l_ms)} | {f(l_tg)} | {f(l_pp)} | {f(p_ms)} | {f(p_pp)} | {f(r1, 2)} | {f(r2, 2)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/real-shapes/raw"))
