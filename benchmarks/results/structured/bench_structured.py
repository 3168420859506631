"""Step-time cost of structured outputs: the same requests with and without a JSON-schema
constraint, at batch size 1 and 64 concurrent requests, on the default model.

Every request runs exactly --output-len tokens both ways (the schema asks for more tokens than
that, so no constrained output completes early), so the walls differ only by the constraint's
work: the step's wait for masks (computed ahead in mask threads, llguidance; waited for at most a
tenth of a step, else the sequence sits the step out) and applying them to the logits. Passes alternate
(unconstrained, constrained) and the median of --repeats is kept. Writes results.json and
results.md next to this file.

    flock /tmp/pagedllm-bench.lock python3 benchmarks/results/structured/bench_structured.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.sampler import AllowedTokens
from pagedllm.structured_output.manager import StructuredOutputManager

HERE = os.path.dirname(os.path.abspath(__file__))
# Forty strings of 10-30 characters: far more tokens than --output-len, so no constrained output
# ends early.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "items": {
            "type": "array",
            "items": {"type": "string", "minLength": 10, "maxLength": 30},
            "minItems": 40,
            "maxItems": 40,
        },
    },
    "required": ["title", "items"],
    "additionalProperties": False,
}
TOPICS = ["fruits", "rivers", "cities", "colours", "tools", "birds", "planets", "metals"]


class Timer:
    """Wall time spent inside a method, summed (monkeypatched around it)."""

    def __init__(self, owner: type, name: str) -> None:
        self.total = 0.0
        real = getattr(owner, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.total += time.perf_counter() - t

        setattr(owner, name, timed)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    # What a step waits for masks: the grace for those in flight, and any it cannot do without.
    mask_timers = [Timer(StructuredOutputManager, "settle"), Timer(StructuredOutputManager, "bitmask")]
    apply_timer = Timer(AllowedTokens, "apply")
    llm = LLM(args.model, enable_prefix_caching=False)
    results = []
    for batch in (1, 64):
        prompts = [f"Write a JSON object listing forty {TOPICS[i % len(TOPICS)]} (list {i}):" for i in range(batch)]
        plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        constrained = SamplingParams(
            temperature=0.0, max_tokens=args.output_len, ignore_eos=True, structured_outputs={"json": SCHEMA}
        )
        llm.generate(prompts[:1], constrained, use_tqdm=False)  # compile + warm up
        walls: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
        mask_s, apply_s = [], []
        for _ in range(args.repeats):
            for name, params in (("unconstrained", plain), ("constrained", constrained)):
                for timer in (*mask_timers, apply_timer):
                    timer.total = 0.0
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                walls[name].append(time.perf_counter() - t)
                assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
                if name == "constrained":
                    mask_s.append(sum(timer.total for timer in mask_timers))
                    apply_s.append(apply_timer.total)
        base, cons = statistics.median(walls["unconstrained"]), statistics.median(walls["constrained"])
        row = {
            "batch": batch,
            "output_len": args.output_len,
            "unconstrained_s": round(base, 3),
            "constrained_s": round(cons, 3),
            "overhead": round(cons / base - 1, 4),
            "mask_wait_s": round(statistics.median(mask_s), 3),
            "mask_apply_s": round(statistics.median(apply_s), 3),
            "walls_s": {k: [round(w, 3) for w in v] for k, v in walls.items()},
        }
        results.append(row)
        print(json.dumps(row))
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump({"model": args.model, "schema": SCHEMA, "results": results}, f, indent=2)
    lines = [
        "# Structured outputs: step-time overhead",
        "",
        f"Default model ({args.model}, native GGUF), greedy, {args.output_len} new tokens per request, the",
        "same prompts with and without a JSON-schema constraint (llguidance masks), median of "
        f"{args.repeats} alternating passes.",
        "Made by `flock /tmp/pagedllm-bench.lock python3 benchmarks/results/structured/bench_structured.py`.",
        "",
        "| concurrent requests | unconstrained s | constrained s | overhead | step's mask wait s | mask apply s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['batch']} | {r['unconstrained_s']} | {r['constrained_s']} | {r['overhead'] * 100:+.1f}% "
            f"| {r['mask_wait_s']} | {r['mask_apply_s']} |"
        )
    with open(os.path.join(HERE, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
