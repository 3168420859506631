"""Where a throughput run's forward time goes, by operation class (wall time, synchronous CPU).

python op_profile.py MODEL WORKLOAD.json   (greedy, ignore EOS, as the bench; run under tcmalloc:
LD_PRELOAD=libtcmalloc_minimal.so.4). Wrapping each call adds a little overhead to the total.
"""

import collections
import json
import sys
import time

import pagedllm.attention.paged_attention as pa
import pagedllm.models.fused_cpu_decoder as fused_cpu_decoder
from pagedllm import LLM, SamplingParams
from pagedllm.models.cpu_linear import PackedLinear

T = collections.Counter()


def timed(f, key):
    def g(*a, **k):
        t = time.perf_counter()
        out = f(*a, **k)
        T[key] += time.perf_counter() - t
        return out

    return g


def gemm_key(rows):
    return "gemm rows<=6" if rows <= 6 else ("gemm rows 7-256" if rows <= 256 else "gemm rows>256")


def timed_gemm(method):  # counted by the rows of x
    def g(self, x):
        t = time.perf_counter()
        out = method(self, x)
        T[gemm_key(x.shape[0])] += time.perf_counter() - t
        return out

    return g


# before the engine resolves the layers' bound methods; silu_and_mul: the gate/up GEMM with its epilogue
PackedLinear.forward = timed_gemm(PackedLinear.forward)
PackedLinear.silu_and_mul = timed_gemm(PackedLinear.silu_and_mul)
pa._prefill = timed(pa._prefill, "prefill attention (SDPA)")
fused_cpu_decoder.attend = timed(fused_cpu_decoder.attend, "attention, all")


class TimedKernels:
    def __init__(self, k):
        self.k = k

    def __getattr__(self, name):
        return timed(getattr(self.k, name), name)


model, workload = sys.argv[1], sys.argv[2]
requests = json.load(open(workload))["requests"]
engine = LLM(model=model, dtype="bfloat16").llm_engine
m = engine.runner.model
m.kernels = TimedKernels(m.kernels)
engine.runner.decode_kernel = timed(engine.runner.decode_kernel, "decode attention kernel")
m.forward = timed(m.forward, "forward")
m.compute_logits = timed(m.compute_logits, "logits (LM head)")
m.greedy_tokens = timed(m.greedy_tokens, "LM head argmax (greedy steps, no logits)")


class TimedSampler:  # the runner also asks the sampler things (argmax_only): only calls are timed
    def __init__(self, s):
        self.s = s
        self.timed_call = timed(s.__call__, "sampler")

    def __getattr__(self, name):
        return getattr(self.s, name)

    def __call__(self, *a):
        return self.timed_call(*a)


engine.runner.sampler = TimedSampler(engine.runner.sampler)
for i, r in enumerate(requests):
    params = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
    engine.add_request(str(i), {"prompt_token_ids": r["prompt_token_ids"]}, params)
t0 = time.perf_counter()
while engine.has_unfinished_requests():
    engine.step()
print(f"wall {time.perf_counter() - t0:.1f} s")
for k, v in T.most_common():
    print(f"{k}: {v:.2f} s")
