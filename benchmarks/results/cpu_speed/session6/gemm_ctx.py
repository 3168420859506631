"""Do decode GEMMs slow down when attention streams a long K/V? The same M rows, short vs long context.

python gemm_ctx.py MODEL M CTX [CTX ...]   (M prompts of CTX random tokens, 150 greedy tokens each;
run under tcmalloc and the benchmark lock). Prints the mean time of a PackedLinear call at M rows.
"""

import collections
import sys
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.cpu_linear import PackedLinear

model, rows = sys.argv[1], int(sys.argv[2])
seconds, calls = collections.Counter(), collections.Counter()


def timed(method):
    def wrapper(self, x):
        t = time.perf_counter()
        out = method(self, x)
        if x.shape[0] == rows:
            seconds["gemm"] += time.perf_counter() - t
            calls["gemm"] += 1
        return out

    return wrapper


# before the engine resolves the layers' bound methods
PackedLinear.forward = timed(PackedLinear.forward)
PackedLinear.silu_and_mul = timed(PackedLinear.silu_and_mul)
llm = LLM(model=model, dtype="bfloat16")
g = torch.Generator().manual_seed(0)
params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True, detokenize=False)
for ctx in (int(a) for a in sys.argv[3:]):
    prompts = [{"prompt_token_ids": torch.randint(3, 40000, (ctx,), generator=g).tolist()} for _ in range(rows)]
    seconds.clear()
    calls.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    per_call = seconds["gemm"] / calls["gemm"]
    print(f"M={rows} ctx={ctx}: wall {wall:.2f} s, {calls['gemm']} calls, {per_call * 1e6:.1f} us per call")
