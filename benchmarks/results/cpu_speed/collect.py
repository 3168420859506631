"""Merges the raw output of run_speed.sh into this folder's results.json.

    python3 collect.py [--machine TEXT] RAW_DIR [RAW_DIR ...]

Each RAW_DIR is one run_speed.sh output folder: a set of strictly alternating throughput rounds
(`results.jsonl` rows labelled "pagedllm interleaved runN", `interleaved-anchors.jsonl` rows
"interleaved runN", the host probe's `probe-runN.log`), and, where run, the batch-size-1 and HF
rows (pagedllm's "pagedllm bs1 ..." in results.jsonl, vLLM's "bs1-..." and HF's "hf ..." in
anchors.jsonl). results.json keeps every raw row unchanged under the set it came from.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
TAX = re.compile(r"1024 pages in use, touched every 100 ms:.*= +(\d+) us")


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open() if line.strip()] if path.exists() else []


def round_of(label: str) -> int:
    return int(label.rsplit("run", 1)[1])


def collect_set(raw: Path) -> dict:
    ours = rows(raw / "results.jsonl")
    theirs = rows(raw / "interleaved-anchors.jsonl")
    pagedllm = {round_of(r["label"]): r for r in ours if r["label"].startswith("pagedllm interleaved run")}
    vllm = {round_of(r["label"]): r for r in theirs if r["label"].startswith("interleaved run")}
    rounds = []
    for i in sorted(pagedllm):
        probe = raw / f"probe-run{i}.log"
        tax = TAX.search(probe.read_text()) if probe.exists() else None
        rounds.append(
            {
                "round": i,
                "host_tax_us_per_page_s": int(tax.group(1)) if tax else None,
                "vllm": vllm[i],
                "pagedllm": pagedllm[i],
                "ratio": round(pagedllm[i]["output_tok_s"] / vllm[i]["output_tok_s"], 3),
            }
        )
    med_ours = statistics.median(r["pagedllm"]["output_tok_s"] for r in rounds)
    med_vllm = statistics.median(r["vllm"]["output_tok_s"] for r in rounds)
    out: dict = {
        "rounds": rounds,
        "median_output_tok_s": {"pagedllm": med_ours, "vllm": med_vllm, "ratio": round(med_ours / med_vllm, 3)},
    }
    anchors = rows(raw / "anchors.jsonl")
    bs1 = [r for r in ours if r["label"].startswith("pagedllm bs1")]
    if bs1:
        vllm_bs1 = [r for r in anchors if r["label"].startswith("bs1-")]
        out["batch_size_1"] = {
            "pagedllm": bs1[-1],
            "vllm": vllm_bs1,
            "vllm_median_ms_per_output_token": statistics.median(r["ms_per_output_token"] for r in vllm_bs1),
        }
    hf = [r for r in anchors if r["label"].startswith("hf ")]
    if hf:
        out["hf_static_batches"] = hf
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw_dirs", nargs="+", type=Path)
    ap.add_argument("--machine", default=None, help="the machine, in words (default: /proc/cpuinfo's model name)")
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    a = ap.parse_args()
    machine = a.machine
    if machine is None:
        names = re.findall(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
        machine = f"{names[0]}, {len(names)} CPUs" if names else "unknown"
    sets = [collect_set(d) for d in a.raw_dirs]
    first = sets[0]["rounds"][0]["pagedllm"]
    result = {
        "what": "output tok/s of pagedllm vs vLLM's CPU build in strictly alternating rounds, batch size 1 "
        "ms/token, HF transformers static batches; all on the anchors' model and 200-request workload",
        "machine": machine,
        "model": "smol135-random (benchmarks/anchors/make_model.py, SmolLM2-135M shape, random weights)",
        "workload": first["workload"],
        "sets": sets,
    }
    a.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
