"""results.jsonl of run_ab.sh -> results.json + README.md (ratio new / old by medians)."""

import json
import statistics
import sys
from pathlib import Path

out, old_rev, new_rev = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
runs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
side = {s: [r for r in runs if r["label"].startswith(s)] for s in ("old", "new")}
med = {s: statistics.median(r["output_tok_s"] for r in rs) for s, rs in side.items()}
summary = {
    "old_rev": old_rev,
    "new_rev": new_rev,
    "median_output_tok_s": med,
    "ratio_new_over_old": med["new"] / med["old"],
    "runs": [{k: r[k] for k in ("label", "output_tok_s", "wall_s", "engine_steps", "dtype", "time")} for r in runs],
}
(out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
rows = "\n".join(
    f"| {r['label']} | {r['time']} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {r['engine_steps']:.0f} |"
    for r in runs
)
w = runs[0]["workload"]
(out / "README.md").write_text(
    f"""# Engine before / after the scheduler -> runner contract (A/B)

`pagedllm bench throughput --workload sharegpt --num-prompts {w["num_requests"]} --repeats 1` on the
default model (SmolLM2-135M-Instruct, {runs[0]["dtype"]}), the engine at `{old_rev}` (before the change)
against `{new_rev}`, strictly alternating single runs under one flock
(`bash benchmarks/results/architecture_ab/run_ab.sh`). {w["prompt_tokens_total"]} prompt +
{w["output_tokens_total"]} output tokens.

| run | time | wall s | output tok/s | engine steps |
|---|---|---|---|---|
{rows}

Median output tok/s: old {med["old"]:.1f}, new {med["new"]:.1f}: **new / old = {med["new"] / med["old"]:.3f}**.

Machine: 2 cores, AMD EPYC Zen 3 (AVX2, no AVX512), so the engine runs float32 on the PyTorch
reference path (the compiled bf16 kernels need AVX512-BF16); the change touches the host side of a
step (scheduling, the runner's batch building), which this measures. Other work shared the machine
during the runs (compiles and editing outside the lock), so single runs carry a few percent of noise.
"""
)
print((out / "README.md").read_text())
