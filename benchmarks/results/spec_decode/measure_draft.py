"""Draft-model speculative decoding vs none, batch 1, on measure.py's prompts.

The target is the default model with float weights (its GGUF dequantized at load:
``quantization=None``), the draft the same model in its default form (Q4_1 run in its blocks):
a draft that agrees with the target most of the time at a fraction of its weight traffic. Both
engines have the same KV budget (the speculating one splits it between the two caches), run the
same prompts in one process, alternately, 3 timed passes each after a warm-up; the result is each
engine's median output tok/s, the ratio, and the draft acceptance (and, for reference, the
draft model alone: faster still, with its own outputs). Greedy outputs must be
identical (checked).

    flock /tmp/pagedllm-bench.lock python3 benchmarks/results/spec_decode/measure_draft.py [k]

writes results_draft.json and results_draft.md beside this script, with the CPU recorded.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from measure import HERE, alternating_passes, machine, workloads

MODEL = "smollm2-135m-instruct"
KV_GIB = 0.5


def main() -> None:
    from pagedllm import LLM

    k = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    spec = {"model": MODEL, "num_speculative_tokens": k}
    prompts = workloads()["code"]
    target = dict(model=MODEL, quantization=None, kv_cache_memory_gib=KV_GIB)
    engines = {
        "none": LLM(**target),
        "draft": LLM(**target, speculative_config=spec),
        # For reference, not compared: the draft alone is faster still, but its outputs are its own.
        "draft model alone": LLM(model=MODEL, kv_cache_memory_gib=KV_GIB),
    }
    walls, tokens, texts = alternating_passes(engines, prompts)
    assert texts["none"] == texts["draft"], "greedy output changed with speculation"
    stats = engines["draft"].llm_engine.get_stats()
    counters = {key: v for key, v in stats.items() if key.startswith("spec_decode")}
    rows = []
    for name in engines:
        med = statistics.median(walls[name])
        rows.append({"engine": name, "output_tokens": tokens[name], "median_s": round(med, 2)})
        rows[-1]["output_tok_s"] = round(tokens[name] / med, 1)
    ratio = round(rows[1]["output_tok_s"] / rows[0]["output_tok_s"], 2)
    command = "flock /tmp/pagedllm-bench.lock python3 benchmarks/results/spec_decode/measure_draft.py"
    result = {
        "machine": machine(),
        "target": f"{MODEL} (quantization=None: float weights)",
        "speculative_config": spec,
        "kv_cache_memory_gib": KV_GIB,
        "rows": rows,
        "speedup": ratio,
        "spec_stats": counters,
        "walls_s": walls,
        "command": f"{command} {k}",
    }
    with open(os.path.join(HERE, "results_draft.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    m = result["machine"]
    lines = [
        "# Draft-model speculative decoding, batch 1, input-grounded prompts",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags'])}.",
        "",
        f"Command: `{result['command']}`",
        "",
        "| engine | output tokens | median s | output tok/s |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['engine']} | {r['output_tokens']} | {r['median_s']} | {r['output_tok_s']} |" for r in rows]
    lines += ["", f"Speed-up: **{ratio}x**; greedy outputs identical. Speculation counters: {counters}", ""]
    with open(os.path.join(HERE, "results_draft.md"), "w") as fh:
        fh.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
