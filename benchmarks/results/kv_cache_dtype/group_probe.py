"""How large may an int8 cache's scale groups be, and how finely does this file's perplexity
resolve a cache's rounding? Emulated on a float32 cache: every K/V row the engine writes is
replaced by a transformed copy, then `bench perplexity` (KJV Romans, context 512) of the Gemma 3
270M Q4_K_M file (256-wide heads) runs as usual. Each argument is one run:

  G (an integer)     int8 round trip with a scale per G values (0: the float32 cache itself);
                     what chose int8_kv.GROUP; not the int8 cache itself (its kernels fold the
                     scales into the scores, a different float rounding)
  float16, bfloat16  a round trip through that dtype: the 16-bit caches' rounding, nothing else
  x1+2^-N, x1-2^-N   every value times (1 +- 2^-N): a perturbation far below any cache's rounding

    flock /tmp/pagedllm-bench.lock python3 benchmarks/results/kv_cache_dtype/group_probe.py 0 256 128 64 32
    flock /tmp/pagedllm-bench.lock python3 benchmarks/results/kv_cache_dtype/group_probe.py 0 float16 bfloat16 x1+2^-20

prints one line per run: its perplexity and the change against the first one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import pagedllm.attention.paged_attention as pa  # noqa: E402
from pagedllm.kernels.interface import CpuKernels  # noqa: E402

_mode = ["0"]


def transform(mode: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The rows' transformation for one run's argument (module docstring), or None: unchanged."""
    if mode in ("float16", "bfloat16"):
        dtype = getattr(torch, mode)
        return lambda x: x.to(dtype).to(x.dtype)
    if mode.startswith("x1"):
        sign, exp = mode[2], int(mode.split("^-")[1])
        factor = 1.0 + (2.0**-exp if sign == "+" else -(2.0**-exp))
        return lambda x: x * factor
    group = int(mode)
    return (lambda x: int8_round_trip(x, group)) if group else None


def int8_round_trip(x: torch.Tensor, group: int) -> torch.Tensor:
    """x through int8 with a scale per ``group`` values of each row (as int8_kv.quantize per group)."""
    *lead, d = x.shape
    g = min(group, d)
    xg = x.float().reshape(*lead, d // g, g)
    sc = xg.abs().amax(-1, keepdim=True) / 127
    sc = torch.where(sc >= torch.finfo(torch.float32).tiny, sc, torch.zeros_like(sc))
    q = (xg / torch.where(sc > 0, sc, 1.0)).round().clamp(-127, 127)
    return (q * sc).reshape(x.shape).to(x.dtype)


_write, _rope_write = pa.write_kv_cache, CpuKernels.rope_and_cache_write


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping):  # Gemma 3's path (models/llama.py)
    if (f := transform(_mode[0])) is not None:
        key, value = f(key), f(value)
    _write(key, value, k_cache, v_cache, slot_mapping)


def rope_and_cache_write(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, nh, nkv):  # fused loop
    _rope_write(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, nh, nkv)
    if (f := transform(_mode[0])) is not None:
        bs = k_cache.shape[2]
        b, o = slot_mapping // bs, slot_mapping % bs
        for c in (k_cache, v_cache):
            c[b, :, o] = f(c[b, :, o])


def main() -> None:
    from gemma3_real_file import assemble

    from pagedllm.entrypoints.cli import main as cli

    pa.write_kv_cache = write_kv_cache
    CpuKernels.rope_and_cache_write = rope_and_cache_write
    base = None
    text = os.path.join(ROOT, "benchmarks", "data", "kjv-romans.txt")
    with tempfile.TemporaryDirectory() as tmp:
        model, out = assemble(tmp), os.path.join(tmp, "ppl.json")
        for mode in sys.argv[1:]:
            _mode[0] = mode
            cmd = ["bench", "perplexity", "--model", model, "--text", text]
            cli(cmd + ["--context", "512", "--kv-cache-dtype", "float32", "--output-json", out])
            with open(out) as fh:
                ppl = json.load(fh)["ppl"]
            base = base or ppl
            print(f"{mode}: ppl {ppl:.4f} ({100 * (ppl / base - 1):+.2f}%)", flush=True)


if __name__ == "__main__":
    main()
