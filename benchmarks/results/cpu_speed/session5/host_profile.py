"""Where a throughput run's wall time goes outside the model: engine.step phases (wall time).

python host_profile.py MODEL WORKLOAD.json   (greedy, ignore EOS, as the bench; under tcmalloc)
"""

import collections
import json
import sys
import time

from pagedllm import LLM, SamplingParams

T = collections.Counter()


def timed(obj, name, key):
    f = getattr(obj, name)

    def g(*a, **k):
        t = time.perf_counter()
        out = f(*a, **k)
        T[key] += time.perf_counter() - t
        return out

    setattr(obj, name, g)


model, workload = sys.argv[1], sys.argv[2]
requests = json.load(open(workload))["requests"]
engine = LLM(model=model, dtype="bfloat16").llm_engine
runner = engine.runner
timed(engine.scheduler, "schedule", "schedule")
timed(engine.scheduler, "update_after_step", "update_after_step")
timed(runner, "_prepare", "runner._prepare")
timed(runner.model, "forward", "model.forward")
timed(runner.model, "compute_logits", "compute_logits")
timed(runner.model, "greedy_tokens", "greedy_tokens")
timed(type(runner.sampler), "__call__", "sampler")  # on the class: the runner also calls its argmax_only
timed(runner, "execute", "runner.execute")
for i, r in enumerate(requests):
    params = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
    engine.add_request(str(i), {"prompt_token_ids": r["prompt_token_ids"]}, params)
t0 = time.perf_counter()
while engine.has_unfinished_requests():
    t = time.perf_counter()
    engine.step()
    T["engine.step"] += time.perf_counter() - t
print(f"wall {time.perf_counter() - t0:.1f} s")
for k, v in T.most_common():
    print(f"{k}: {v:.2f} s")
