"""How much perplexity does rounding the GEMM inputs cost, and where? The default model's float
weights (the GGUF dequantized at load) on the PyTorch reference path, with every linear layer's
input rounded as an integer kernel would round it (symmetric, a scale per block of B values,
d = amax / qmax), per layer kind. Isolates activation rounding from weight quantization: the
native Q4_1 engine computes the same weights' products exactly in integers, so its distance
from the float run is this rounding alone.

    flock /tmp/pagedllm-bench.lock python3 activation_rounding_ppl.py MODE [CHUNKS]

MODE: none | b32 (int8 per 32: the Q4_0/Q4_1/Q4_K kernels) | b16 (int8 per 16) | b256 (int8 per
256: llama.cpp's Q8_K) | b32_down16bit (int8 per 32, int16 for down_proj's input) |
b32_down_b16 (int8 per 32, per 16 for down_proj's input) | b32_only_down (only down_proj rounded).
Prints one JSON line: the mode, chunks and perplexity (KJV Romans, context 512, as `bench
perplexity`).
"""

from __future__ import annotations

import json
import os
import sys

import torch

import pagedllm.layers.linear as linear
from pagedllm import LLM
from pagedllm.bench.perplexity import perplexity, read_text, tokenize

TEXT = os.path.join(os.path.dirname(__file__), "..", "data", "kjv-romans.txt")


def rounded(x: torch.Tensor, block: int, qmax: int) -> torch.Tensor:
    xb = x.reshape(-1, block)
    d = xb.abs().amax(dim=1, keepdim=True) / qmax
    d = torch.where(d == 0, torch.ones_like(d), d)
    return (torch.round(xb / d) * d).reshape(x.shape)


def rounding_for(mode: str, layer: linear.ParallelLinear, x: torch.Tensor) -> torch.Tensor:
    # down_proj: the only RowParallelLinear wider than the hidden size (o_proj's input is hidden)
    down = isinstance(layer, linear.RowParallelLinear) and layer.in_features > layer.out_features
    rules = {
        "none": None,
        "b32": (32, 127),
        "b16": (16, 127),
        "b256": (256, 127),
        "b32_down16bit": (32, 32767 if down else 127),
        "b32_down_b16": (16 if down else 32, 127),
        "b32_only_down": (32, 127) if down else None,
    }
    rule = rules[mode]
    return x if rule is None else rounded(x, *rule)


def main() -> None:
    mode = sys.argv[1]
    chunks = int(sys.argv[2]) if len(sys.argv) > 2 else None
    plain, row = linear.ParallelLinear.forward, linear.RowParallelLinear.forward
    linear.ParallelLinear.forward = lambda self, x: plain(self, rounding_for(mode, self, x))
    linear.RowParallelLinear.forward = lambda self, x: row(self, rounding_for(mode, self, x))
    # attention_backend="torch": every layer through the Python modules patched above
    llm = LLM(
        model="smollm2-135m-instruct",
        quantization="none",
        attention_backend="torch",
        num_threads=2,
        kv_cache_memory_gib=0.5,
    )
    tokens, bos = tokenize(llm.get_tokenizer(), read_text(TEXT))
    r = perplexity(llm, tokens, 512, bos, chunks)
    print(json.dumps({"mode": mode, "chunks": r.chunks, "ppl": r.ppl}))


if __name__ == "__main__":
    main()
