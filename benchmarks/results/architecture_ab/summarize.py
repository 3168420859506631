"""results.jsonl of run_ab.sh -> results.json + README.md (ratios new / old by medians)."""

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from pagedllm.kernels.build import cpu_flags, cpu_model  # noqa: E402

out, old_rev, new_rev, change = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
runs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def side(kind: str, name: str) -> list[dict]:
    return [r for r in runs if r["bench"] == kind and r["label"].startswith(name)]


tput = {s: statistics.median(r["output_tok_s"] for r in side("throughput", s)) for s in ("old", "new")}
bs1 = {s: statistics.median(r["ms_per_output_token"] for r in side("latency", s)) for s in ("old", "new")}
isa = sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"))
machine = f"{cpu_model()}, {os.cpu_count()} cores, {' '.join(isa)}"
summary = {
    "old_rev": old_rev,
    "new_rev": new_rev,
    "change": change,
    "machine": machine,
    "median_output_tok_s": tput,
    "throughput_new_over_old": tput["new"] / tput["old"],
    "median_bs1_ms_per_output_token": bs1,
    "bs1_new_over_old": bs1["new"] / bs1["old"],
    "runs": [
        {k: r[k] for k in ("bench", "label", "output_tok_s", "ms_per_output_token", "wall_s", "dtype", "time")}
        for r in runs
    ],
}
(out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
rows = "\n".join(
    f"| {r['bench']} | {r['label']} | {r['time']} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} "
    f"| {r['ms_per_output_token']:.2f} |"
    for r in runs
)
w = next(r for r in runs if r["bench"] == "throughput")["workload"]
(out / "README.md").write_text(
    f"""# Engine A/B: {change}

The default model (SmolLM2-135M-Instruct, GGUF Q4_1, {runs[0]["dtype"]} activations), the engine at
`{old_rev}` against `{new_rev}`, strictly alternating single runs under one flock
(`OLD_REV={old_rev} CHANGE="..." bash benchmarks/results/architecture_ab/run_ab.sh`):
- throughput: `pagedllm bench throughput --workload sharegpt --num-prompts {w["num_requests"]} --repeats 1`
  ({w["prompt_tokens_total"]} prompt + {w["output_tokens_total"]} output tokens, all submitted at once);
- batch size 1: `pagedllm bench latency --workload sharegpt --num-prompts 10 --repeats 1` (ms per
  output token, prefill included).

| benchmark | run | time | wall s | output tok/s | ms / output token |
|---|---|---|---|---|---|
{rows}

Medians: throughput old {tput["old"]:.1f}, new {tput["new"]:.1f} output tok/s: **new / old =
{tput["new"] / tput["old"]:.3f}**; batch size 1 old {bs1["old"]:.2f}, new {bs1["new"]:.2f} ms/token:
**new / old = {bs1["new"] / bs1["old"]:.3f}** (lower is faster).

Machine: {machine}. Single runs on a shared 2-core VM carry a few percent of noise.
"""
)
print((out / "README.md").read_text())
