"""Where a throughput run's time goes: wall time of each engine step by kind and decode batch size.

python step_profile.py MODEL WORKLOAD.json [temperature=T] [engine_arg=int ...]
(greedy unless temperature is given, ignore EOS, as the bench)
"""

import collections
import json
import sys
import time

from pagedllm import LLM, SamplingParams

model, workload = sys.argv[1], sys.argv[2]
args = dict(a.split("=") for a in sys.argv[3:])
temperature = float(args.pop("temperature", 0))
engine_args = {k: int(v) for k, v in args.items()}
requests = json.load(open(workload))["requests"]
engine = LLM(model=model, dtype="bfloat16", **engine_args).llm_engine
for i, r in enumerate(requests):
    params = SamplingParams(temperature=temperature, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
    engine.add_request(str(i), {"prompt_token_ids": r["prompt_token_ids"]}, params)

steps = []  # (seconds, decodes, prefill tokens)
execute = engine.runner.execute


def timed_execute(sched):
    counts = sched.num_scheduled_tokens.values()
    decodes = sum(1 for n in counts if n == 1)
    prefill = sum(n for n in counts if n > 1)
    t = time.perf_counter()
    out = execute(sched)
    steps.append((time.perf_counter() - t, decodes, prefill))
    return out


engine.runner.execute = timed_execute
t0 = time.perf_counter()
while engine.has_unfinished_requests():
    engine.step()
print(f"wall {time.perf_counter() - t0:.1f} s, {len(steps)} steps")
pre = [s for s in steps if s[2]]
print(f"steps with prefill: {len(pre)}, {sum(s[0] for s in pre):.1f} s, {sum(s[2] for s in pre)} prompt tokens")
buckets = collections.defaultdict(list)
for s in steps:
    if not s[2]:
        buckets[min(s[1] // 25 * 25, 200)].append(s)
for b in sorted(buckets):
    ss = buckets[b]
    t, tokens = sum(s[0] for s in ss), sum(s[1] for s in ss)
    print(f"decode batch {b}-{b + 24}: {len(ss)} steps, {t:.1f} s, {t / len(ss) * 1e3:.1f} ms/step, {tokens} tokens")
