"""n-gram speculative decoding vs none, batch 1, the default model, input-grounded prompts.

Two workloads that copy from their input, as editing, quoting and code do: ``code`` gives a short
Python function and asks for it back with one name changed; ``quote`` gives a paragraph and asks
for it word for word (greedy, 256 tokens at most, one request at a time). Each workload runs the
engine without speculation and with each n-gram config of SPECS, in one process, alternately, 3
timed passes each after a warm-up; the result is each engine's median output tok/s, the ratios,
and each speculating engine's draft acceptance. Greedy outputs must be identical (checked).

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
QUOTES = [
    "The Industrial Revolution began in Britain in the late eighteenth century. Steam engines, first used to "
    "pump water out of mines, were soon driving looms and locomotives. Factories drew workers from the "
    "countryside into fast-growing towns, where wages were low and hours were long. Within a century the new "
    "ways of making goods had spread across Europe and North America.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. In the "
    "chloroplasts, light splits water into oxygen and hydrogen, and the energy captured is used to build "
    "sugars from carbon dioxide. The oxygen is released into the air, and the sugars feed the plant and, in "
    "turn, the animals that eat it.",
    "To reset your password, open the settings page and choose Account. Click the link that says Forgot "
    "password, then enter the email address you used to sign up. We will send you a message with a six-digit "
    "code. Type the code into the box, choose a new password of at least twelve characters, and save it.",
]
# vLLM's keys. min 1 proposes after any one-token match; min 2 waits for a two-token one, which
# this model's paraphrases break less often, so fewer verifying passes are spent on drafts it rejects.
SPECS = {
    "ngram k4 min1 max3": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    },
    "ngram k4 min2 max4": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    },
    # vLLM's documented example drafts 5 tokens: a verifying pass of 6 rows costs little more
    # than one of 5 since the group kernels take up to six rows at once.
    "ngram k5 min2 max4": {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    },
}


def workloads() -> dict[str, list[list[dict]]]:
    code = [
        [{"role": "user", "content": f"Here is a function:\n\n{c}\n\nRepeat it exactly, but rename `{a}` to `{b}`."}]
        for c, (a, b) in zip(CODE, RENAMES, strict=True)
    ]
    quote = [[{"role": "user", "content": f"{q}\n\nQuote the text above word for word."}] for q in QUOTES]
    return {"code": code, "quote": quote}


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


def alternating_passes(engines: dict, prompts: list[list[dict]]):
    """Greedy passes (256 tokens at most) of every engine over ``prompts`` in turn, a warm-up then
    3 timed: (each engine's timed walls, its output tokens per pass, its output texts)."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=256)
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
    return walls, tokens, texts


def run_workload(engines: dict, prompts: list[list[dict]]) -> dict:
    """Alternating passes of every engine over ``prompts``: medians, ratios, acceptance."""
    before = {name: dict(llm.llm_engine.get_stats()) for name, llm in engines.items()}
    walls, tokens, texts = alternating_passes(engines, prompts)
    rows = []
    for name, llm in engines.items():
        assert texts[name] == texts["none"], f"greedy output changed with {name}"
        med = statistics.median(walls[name])
        stats = llm.llm_engine.get_stats()
        spec = {k: _delta(v, before[name].get(k)) for k, v in stats.items() if k.startswith("spec_decode")}
        rows.append(
            {
                "engine": name,
                "output_tokens": tokens[name],
                "median_s": round(med, 2),
                "output_tok_s": round(tokens[name] / med, 1),
                "spec_stats": spec,
            }
        )
    for r in rows:
        r["vs_none"] = round(r["output_tok_s"] / rows[0]["output_tok_s"], 2)
    return {"rows": rows, "walls_s": walls}


def _delta(now, before):
    """A counter's growth over this workload (the per-position list too)."""
    if isinstance(now, list):
        return [a - b for a, b in zip(now, before or [0] * len(now), strict=True)]
    return now - (before or 0)


def main() -> None:
    from pagedllm import LLM

    engines = {"none": LLM(), **{name: LLM(speculative_config=cfg) for name, cfg in SPECS.items()}}
    results = {name: run_workload(engines, prompts) for name, prompts in workloads().items()}
    result = {
        "machine": machine(),
        "model": "smollm2-135m-instruct (Q4_1, native)",
        "speculative_configs": SPECS,
        "workloads": results,
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
        "| workload | engine | output tokens | median s | output tok/s | vs none | drafts accepted |",
        "|---|---|---|---|---|---|---|",
    ]
    for wname, res in results.items():
        for r in res["rows"]:
            st = r["spec_stats"]
            acc = f"{st['spec_decode_num_accepted_tokens']} / {st['spec_decode_num_draft_tokens']}" if st else ""
            lines.append(
                f"| {wname} | {r['engine']} | {r['output_tokens']} | {r['median_s']} | {r['output_tok_s']} "
                f"| {r['vs_none']} | {acc} |"
            )
    lines += ["", "Greedy outputs identical in every run (checked). Drafts counted over all four passes.", ""]
    with open(os.path.join(HERE, "results.md"), "w") as fh:
        fh.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
