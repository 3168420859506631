"""n-gram speculative decoding vs none, batch 1, the default model, input-grounded prompts.

Workloads that copy from their input, as editing, quoting and code do, each phrased two ways
(greedy, 256 tokens at most, one request at a time):
- ``code`` gives a short Python function and asks for it back with one name changed, the
  instruction after the code; ``rename`` asks the same with the instruction first;
- ``quote`` gives a paragraph and asks for it word for word, the instruction after it;
  ``repeat`` says "Repeat the following text exactly:" before it.
The 135M model copies more faithfully when the instruction comes first (it paraphrases less), so
both phrasings are kept: the result is what the model's own copying allows either way.
Each workload runs the engine without speculation and with each n-gram config of SPECS, in one
process, alternately, 3 timed passes each after a warm-up, every request timed on its own; the
result is each engine's median output tok/s, the ratios, each speculating engine's draft
acceptance, and the same ratio over the requests that stopped by themselves (a request the model
sends into a loop until max_tokens is the easiest to draft for: the ratio without those says
what copying alone gave). Greedy outputs must be identical (checked).

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
# The first three paragraphs were the workload's from the start; the last three were added with the
# instruction-first phrasing, so that one paragraph's behaviour weighs less.
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
    "The library opens at nine in the morning and closes at six in the evening on weekdays. On Saturdays it "
    "closes at one. Books can be borrowed for three weeks and renewed twice, online or at the front desk. "
    "Overdue books cost ten cents a day, up to the price of the book.",
    "Honey bees live in colonies of up to sixty thousand workers, a few hundred drones and a single queen. "
    "The workers gather nectar and pollen, build the comb and feed the young. In winter the bees cluster "
    "together and shiver their muscles to keep the queen warm.",
    "Our return policy is simple. Items in their original packaging can be returned within thirty days for a "
    "full refund. Opened items can be exchanged for store credit. Sale items are final. Please bring your "
    "receipt and the card you paid with.",
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
    rename = [
        [
            {
                "role": "user",
                "content": f"Rename `{a}` to `{b}` in this Python function and show the whole function:"
                f"\n\n```python\n{c}\n```",
            }
        ]
        for c, (a, b) in zip(CODE, RENAMES, strict=True)
    ]
    quote = [[{"role": "user", "content": f"{q}\n\nQuote the text above word for word."}] for q in QUOTES]
    repeat = [[{"role": "user", "content": f"Repeat the following text exactly:\n\n{q}"}] for q in QUOTES]
    return {"code": code, "rename": rename, "quote": quote, "repeat": repeat}


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
    3 timed: (each engine's timed walls per pass and request, its outputs of the last pass)."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=256)
    walls: dict[str, list[list[float]]] = {name: [] for name in engines}
    outputs: dict[str, list] = {}
    for rep in range(4):  # pass 0 warms up
        for name, llm in engines.items():
            outs, times = [], []
            for p in prompts:
                t = time.perf_counter()
                outs.append(llm.chat(p, params, use_tqdm=False)[0].outputs[0])
                times.append(time.perf_counter() - t)
            outputs[name] = outs
            if rep:
                walls[name].append(times)
    return walls, outputs


def run_workload(engines: dict, prompts: list[list[dict]]) -> dict:
    """Alternating passes of every engine over ``prompts``: medians, ratios, acceptance; the same
    over the requests that stopped before max_tokens."""
    before = {name: dict(llm.llm_engine.get_stats()) for name, llm in engines.items()}
    walls, outputs = alternating_passes(engines, prompts)
    stopped = [i for i, o in enumerate(outputs["none"]) if o.finish_reason == "stop"]
    rows = []
    for name, llm in engines.items():
        outs = outputs[name]
        assert [o.text for o in outs] == [o.text for o in outputs["none"]], f"greedy output changed with {name}"
        tokens = sum(len(o.token_ids) for o in outs)
        med = statistics.median(sum(times) for times in walls[name])
        stopped_tokens = sum(len(outs[i].token_ids) for i in stopped)
        stopped_med = statistics.median(sum(times[i] for i in stopped) for times in walls[name])
        stats = llm.llm_engine.get_stats()
        spec = {k: _delta(v, before[name].get(k)) for k, v in stats.items() if k.startswith("spec_decode")}
        rows.append(
            {
                "engine": name,
                "output_tokens": tokens,
                "median_s": round(med, 2),
                "output_tok_s": round(tokens / med, 1),
                "stopped_output_tok_s": round(stopped_tokens / stopped_med, 1) if stopped else None,
                "spec_stats": spec,
            }
        )
    for r in rows:
        r["vs_none"] = round(r["output_tok_s"] / rows[0]["output_tok_s"], 2)
        if stopped:
            r["stopped_vs_none"] = round(r["stopped_output_tok_s"] / rows[0]["stopped_output_tok_s"], 2)
    requests = [{"output_tokens": len(o.token_ids), "finish_reason": o.finish_reason} for o in outputs["none"]]
    return {"rows": rows, "requests": requests, "walls_s": walls}


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
        "| workload | engine | output tokens | median s | output tok/s | vs none | stopped requests: vs none "
        "| drafts accepted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for wname, res in results.items():
        for r in res["rows"]:
            st = r["spec_stats"]
            acc = f"{st['spec_decode_num_accepted_tokens']} / {st['spec_decode_num_draft_tokens']}" if st else ""
            lines.append(
                f"| {wname} | {r['engine']} | {r['output_tokens']} | {r['median_s']} | {r['output_tok_s']} "
                f"| {r['vs_none']} | {r.get('stopped_vs_none', '')} | {acc} |"
            )
    lines += ["", "Output tokens per request and how each ended (max_tokens 256: `length`):", ""]
    for wname, res in results.items():
        reqs = ", ".join(f"{q['output_tokens']} {q['finish_reason']}" for q in res["requests"])
        lines.append(f"- {wname}: {reqs}")
    lines += ["", "Greedy outputs identical in every run (checked). Drafts counted over all four passes.", ""]
    with open(os.path.join(HERE, "results.md"), "w") as fh:
        fh.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
