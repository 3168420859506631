"""Where a 512-token prefill of a GGUF model goes: wall time of the quantized GEMMs by format,
weight shape and rows, beside the whole request (one warm-up request, then one timed).

    cd benchmarks/probes && flock /tmp/pagedllm-bench.lock python3 prefill_linear_profile.py FILE.gguf

Zen 3, 2 threads, the 1.7B-shape Q4_K_M (benchmarks/real_shapes/): 12.7-15.0 s between runs, of
which the GEMMs 92%; the Q4_K ffn gate/up alone 5.3-6.2 s, i.e. 66-78 GMAC/s.
"""

import collections
import sys
import time

from pagedllm import LLM, SamplingParams
from pagedllm.models.quantized_linear import QuantizedLinear

SECONDS: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()
_forward = QuantizedLinear.forward


def timed_forward(self, x):
    start = time.perf_counter()
    y = _forward(self, x)
    key = f"{self.format} {tuple(self.qweight.shape)} M={x.reshape(-1, x.shape[-1]).shape[0]}"
    SECONDS[key] += time.perf_counter() - start
    CALLS[key] += 1
    return y


def main() -> None:
    QuantizedLinear.forward = timed_forward
    llm = LLM(model=sys.argv[1], kv_cache_memory_gib=1)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ids = list(range(1000, 1512))
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)  # warm-up (kernels, scratch)
    SECONDS.clear()
    CALLS.clear()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": [i + 1 for i in ids]}], params, use_tqdm=False)  # no prefix hit
    wall = time.perf_counter() - start
    print(f"prefill 512: {wall:.2f} s = {512 / wall:.1f} tok/s; quantized GEMMs {sum(SECONDS.values()):.2f} s")
    for key, seconds in SECONDS.most_common():
        print(f"  {seconds:6.2f} s  x{CALLS[key]:3d}  {key}")


if __name__ == "__main__":
    main()
