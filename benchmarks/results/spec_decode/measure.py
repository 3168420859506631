"""n-gram speculative decoding vs none, batch 1, the default model, input-grounded prompts.

The workload copies from its input, as editing, quoting and code do: each prompt gives a short
Python function and asks for it back with one name changed (greedy, 256 tokens at most, one
request at a time). Both engines run the same prompts in the same process, alternately, 3 timed
passes each after a warm-up; the result is each engine's median output tok/s, the ratio, and the
draft acceptance of the speculating run. Greedy outputs must be identical (checked).

    flock /tmp/pagedllm-bench.lock python3 benchmarks/results/spec_decode/measure.py

writes results.json and results.md beside this script, with the CPU recorded.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CODE = [
    '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out''',
    '''def merge_intervals(intervals):
    """Merges overlapping [start, end] intervals, sorted by start."""
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged''',
    '''def word_counts(text):
    """How often each lower-cased word occurs in text."""
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts''',
]
RENAMES = [("values", "samples"), ("intervals", "ranges"), ("counts", "tally")]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def machine() -> dict:
    info = {"cpu": platform.processor(), "cores": os.cpu_count(), "flags": []}
    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
        info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name"))
        flags = next(ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags"))
        info["flags"] = sorted(f for f in flags if f in ("avx2", "fma", "f16c", "avx_vnni") or f.startswith("avx512"))
    except (OSError, StopIteration):
        pass
    return info


def main() -> None:
    from pagedllm import LLM, SamplingParams

    prompts = [
        [{"role": "user", "content": f"Here is a function:\n\n{code}\n\nRepeat it exactly, but rename `{a}` to `{b}`."}]
        for code, (a, b) in zip(CODE, RENAMES, strict=True)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=256)
    engines = {"none": LLM(), "ngram": LLM(speculative_config=SPEC)}
    walls: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, int] = {}
    texts: dict[str, list[str]] = {}
    for rep in range(4):  # pass 0 warms up
        for name, llm in engines.items():
            t = time.perf_counter()
            outs = [llm.chat(p, params, use_tqdm=False)[0].outputs[0] for p in prompts]
            wall = time.perf_counter() - t
            tokens[name] = sum(len(o.token_ids) for o in outs)
            texts[name] = [o.text for o in outs]
            if rep:
                walls[name].append(wall)
    assert texts["none"] == texts["ngram"], "greedy output changed with speculation"
    stats = engines["ngram"].llm_engine.get_stats()
    spec = {k: v for k, v in stats.items() if k.startswith("spec_decode")}
    rows = []
    for name in engines:
        med = statistics.median(walls[name])
        rows.append(
            {
                "engine": name,
                "output_tokens": tokens[name],
                "median_s": round(med, 2),
                "output_tok_s": round(tokens[name] / med, 1),
            }
        )
    ratio = round(rows[1]["output_tok_s"] / rows[0]["output_tok_s"], 2)
    result = {
        "machine": machine(),
        "model": "smollm2-135m-instruct (Q4_1, native)",
        "speculative_config": SPEC,
        "rows": rows,
        "speedup": ratio,
        "spec_stats": spec,
        "walls_s": walls,
        "command": "flock /tmp/pagedllm-bench.lock python3 benchmarks/results/spec_decode/measure.py",
    }
    with open(os.path.join(HERE, "results.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    m = result["machine"]
    lines = [
        "# n-gram speculative decoding, batch 1, input-grounded prompts",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags'])}.",
        "",
        f"Command: `{result['command']}`",
        "",
        "| engine | output tokens | median s | output tok/s |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['engine']} | {r['output_tokens']} | {r['median_s']} | {r['output_tok_s']} |" for r in rows]
    lines += ["", f"Speed-up: **{ratio}x**; greedy outputs identical. Speculation counters: {spec}", ""]
    with open(os.path.join(HERE, "results.md"), "w") as fh:
        fh.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
