"""Bars over rounds (run_rounds.sh): each round's figures and ratios, and the medians over rounds.

    python3 summarize_rounds.py OUT [RESULTS_DIR [NAME]]

OUT holds round-1, round-2, ... (each a run_baseline.sh folder). Columns are those the rounds
measured: decode against the floor ("bandwidth decode": a round's floor is the weight bytes a
decode step reads / the read bandwidth measured at that round's start) and 32 x (150 + 128)
("batched"). The ratios are each round's own; the medians are over rounds, each quantity
separately. With RESULTS_DIR: writes NAME.json and NAME.md there (NAME: decode_floor).
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from summarize import ratio, rows

KEYS = (  # (key, header, decimals)
    ("read_gb_s", "read GB/s", 1),
    ("bandwidth_floor_ms_per_token", "floor ms/token", 1),
    ("llamacpp_tg128_ms_per_token", "llama.cpp decode ms/token", 1),
    ("pagedllm_decode_ms_per_token", "pagedllm decode ms/token", 1),
    ("llama_over_floor", "llama.cpp / floor", 2),
    ("pagedllm_decode_over_floor", "pagedllm / floor (bar <= 1.15)", 2),
    ("paged_over_llama", "pagedllm / llama.cpp", 2),
    ("llamacpp_batched32_total_tok_s", "llama.cpp 32 x (150+128) tok/s", 1),
    ("pagedllm_batched32_total_tok_s", "pagedllm 32 x (150+128) tok/s", 1),
    ("ratio_batched_paged_over_llama", "batched paged / llama.cpp (bar >= 2)", 2),
)


def round_rows(out: str) -> dict[str, list[dict]]:
    """Per file, one row per round (rounds in order)."""
    by_file: dict[str, list[dict]] = {}
    rounds = sorted((d for d in os.listdir(out) if d.startswith("round-")), key=lambda d: int(d.split("-")[1]))
    for d in rounds:
        for r in rows(os.path.join(out, d)):
            r = {k: r.get(k) for k, _, _ in KEYS} | {"file": r["file"], "round": d}
            r["llama_over_floor"] = ratio(r["llamacpp_tg128_ms_per_token"], r["bandwidth_floor_ms_per_token"])
            r["paged_over_llama"] = ratio(r["pagedllm_decode_ms_per_token"], r["llamacpp_tg128_ms_per_token"])
            by_file.setdefault(r["file"], []).append(r)
    return by_file


def medians(rs: list[dict]) -> dict:
    out = {"file": rs[0]["file"], "round": "median"}
    for k, _, _ in KEYS:
        vals = [r[k] for r in rs if r[k] is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


def table(by_file: dict[str, list[dict]]) -> str:
    def f(x, d):
        return "-" if x is None else f"{x:.{d}f}"

    every = [r for rs in by_file.values() for r in rs]
    keys = [(k, h, d) for k, h, d in KEYS if any(r[k] is not None for r in every)]
    lines = ["| file | round | " + " | ".join(h for _, h, _ in keys) + " |", "|" + " --- |" * (len(keys) + 2)]
    for rs in by_file.values():
        for r in (*rs, medians(rs)):
            lines.append(f"| {r['file']} | {r['round']} | " + " | ".join(f(r[k], d) for k, _, d in keys) + " |")
    return "\n".join(lines)


def main(out: str, results_dir: str | None = None, name: str = "decode_floor") -> int:
    by_file = round_rows(out)
    machine = ""
    first = os.path.join(out, "round-1", "machine.txt")
    if os.path.exists(first):
        with open(first) as fh:
            machine = fh.read().strip()
    print(machine)
    print(table(by_file))
    if results_dir:
        os.makedirs(results_dir, exist_ok=True)
        result = {"machine": machine.splitlines(), "rounds": by_file, "medians": [medians(r) for r in by_file.values()]}
        with open(os.path.join(results_dir, f"{name}.json"), "w") as fh:
            json.dump(result, fh, indent=2)
        with open(os.path.join(results_dir, f"{name}.md"), "w") as fh:
            fh.write("```\n" + machine + "\n```\n\n" + table(by_file) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
