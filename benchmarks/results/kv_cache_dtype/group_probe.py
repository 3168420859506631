"""How large may an int8 cache's scale groups be? Emulated on a float32 cache: every K/V row the
engine writes is replaced by its int8 round trip with a scale per G values (G = 0: the float32
cache itself), then `bench perplexity` (KJV Romans, context 512) of the Gemma 3 270M Q4_K_M file
(256-wide heads) runs as usual. What chose int8_kv.GROUP; not the int8 cache itself (its kernels
fold the scales into the scores, a different float rounding).

    flock /tmp/pagedllm-bench.lock python3 benchmarks/results/kv_cache_dtype/group_probe.py 0 256 128 64 32

prints one line per G: its perplexity and the change against G = 0 (the first G given).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import pagedllm.attention.paged_attention as pa  # noqa: E402
from pagedllm.kernels.interface import CpuKernels  # noqa: E402

_group = [0]


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x through int8 with a scale per _group[0] values of each row (as int8_kv.quantize per group)."""
    *lead, d = x.shape
    g = min(_group[0], d)
    xg = x.float().reshape(*lead, d // g, g)
    sc = xg.abs().amax(-1, keepdim=True) / 127
    sc = torch.where(sc >= torch.finfo(torch.float32).tiny, sc, torch.zeros_like(sc))
    q = (xg / torch.where(sc > 0, sc, 1.0)).round().clamp(-127, 127)
    return (q * sc).reshape(x.shape).to(x.dtype)


_write, _rope_write = pa.write_kv_cache, CpuKernels.rope_and_cache_write


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping):  # Gemma 3's path (models/llama.py)
    if _group[0]:
        key, value = round_trip(key), round_trip(value)
    _write(key, value, k_cache, v_cache, slot_mapping)


def rope_and_cache_write(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, nh, nkv):  # fused loop
    _rope_write(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, nh, nkv)
    if _group[0]:
        bs = k_cache.shape[2]
        b, o = slot_mapping // bs, slot_mapping % bs
        for c in (k_cache, v_cache):
            c[b, :, o] = round_trip(c[b, :, o])


def main() -> None:
    from gemma3_real_file import assemble

    from pagedllm.entrypoints.cli import main as cli

    pa.write_kv_cache = write_kv_cache
    CpuKernels.rope_and_cache_write = rope_and_cache_write
    base = None
    text = os.path.join(ROOT, "benchmarks", "data", "kjv-romans.txt")
    with tempfile.TemporaryDirectory() as tmp:
        model, out = assemble(tmp), os.path.join(tmp, "ppl.json")
        for g in map(int, sys.argv[1:]):
            _group[0] = g
            cmd = ["bench", "perplexity", "--model", model, "--text", text]
            cli(cmd + ["--context", "512", "--kv-cache-dtype", "float32", "--output-json", out])
            with open(out) as fh:
                ppl = json.load(fh)["ppl"]
            base = base or ppl
            print(f"G={g}: ppl {ppl:.4f} ({100 * (ppl / base - 1):+.2f}%)", flush=True)


if __name__ == "__main__":
    main()
