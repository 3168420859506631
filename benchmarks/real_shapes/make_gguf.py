"""Random-weight GGUF files with real model shapes, for speed comparisons against llama.cpp.

Speed does not depend on the weight values, so instead of downloading a checkpoint this writes a
llama-architecture GGUF of the wanted shape, filled with random normal(0, 0.02) values (fixed
seed; not zeros, so llama-quantize's block scales and importance search behave as on real
weights) and norm weights of 1. The tokenizer metadata (``tokenizer.*``: the 49152-token
byte-level BPE vocabulary, merges, special ids, chat template) is copied from the default
model's GGUF (SmolLM2-135M-Instruct, ``pagedllm.models.resolve.default_model_gguf_path()``),
so pagedllm and llama.cpp both load the files with a working tokenizer.

Shapes:

``1.7b``  SmolLM2-1.7B: hidden 2048, 24 layers, 32 heads, 32 KV heads (head_dim 64),
          intermediate 8192, vocab 49152, tied embeddings (no output.weight), rope_theta 130000,
          rms eps 1e-5, context 8192. 1.71B parameters: ~3.4 GB in F16.
``8b``    Llama-3-8B's layer shapes: hidden 4096, 32 layers, 32 heads, 8 KV heads (head_dim
          128), intermediate 14336, untied output head, rope_theta 500000, rms eps 1e-5, context
          8192, BUT the default model's 49152-token vocabulary instead of Llama 3's 128256 (so
          token_embd and output are 49152 x 4096: 7.38B parameters instead of 8.03B; every
          transformer layer is exactly Llama-3-8B's). ~14.8 GB in F16, ~7.8 GB in Q8_0.
``tiny``  2 layers, hidden 256, for testing this script.

The file is written streaming: every tensor's info goes into the header first
(``GGUFWriter.add_tensor_info``), then each tensor is generated, converted and written on its
own (``write_tensor_data``), so memory stays at about one tensor (the largest: the 8B's
49152 x 4096 embedding, ~0.8 GB as float32) whatever the file size. (``GGUFWriter.add_tensor``
would keep every array until ``write_tensors_to_file``.)

``--type f16`` (default) or ``q8_0`` (quantized per tensor with ``gguf.quants.quantize``, about
half the disk; llama-quantize then needs ``--allow-requantize``). Norm weights are F32 always.

    python3 make_gguf.py 1.7b /tmp/real-shapes/smollm2-1.7b-random-f16.gguf
    llama-quantize /tmp/real-shapes/smollm2-1.7b-random-f16.gguf OUT-Q4_K_M.gguf Q4_K_M

Tensor values come from numpy's PCG64 seeded with ``--seed`` and the tensor's index, so a file is
the same bytes on every run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter


@dataclass(frozen=True)
class Shape:
    name: str
    size_label: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float
    rms_eps: float
    context: int


SHAPES = {
    "1.7b": Shape(
        "SmolLM2-1.7B shape (random weights)", "1.7B", 2048, 24, 32, 32, 8192, 49152, True, 130000.0, 1e-5, 8192
    ),
    "8b": Shape(
        "Llama-3-8B layer shape, 49152 vocab (random weights)",
        "7.4B",
        4096,
        32,
        32,
        8,
        14336,
        49152,
        False,
        500000.0,
        1e-5,
        8192,
    ),
    "tiny": Shape("tiny test shape (random weights)", "tiny", 256, 2, 4, 2, 512, 49152, True, 100000.0, 1e-5, 2048),
}


def default_source() -> str:
    from pagedllm.models.resolve import default_model_gguf_path

    return str(default_model_gguf_path())


def tensor_plan(s: Shape) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape [rows, cols], is_norm) in file order; a linear weight is [out, in]."""
    head_dim = s.hidden // s.heads
    plan = [("token_embd.weight", (s.vocab, s.hidden), False)]
    for i in range(s.layers):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (s.hidden,), True),
            (p + "attn_q.weight", (s.heads * head_dim, s.hidden), False),
            (p + "attn_k.weight", (s.kv_heads * head_dim, s.hidden), False),
            (p + "attn_v.weight", (s.kv_heads * head_dim, s.hidden), False),
            (p + "attn_output.weight", (s.hidden, s.heads * head_dim), False),
            (p + "ffn_norm.weight", (s.hidden,), True),
            (p + "ffn_gate.weight", (s.intermediate, s.hidden), False),
            (p + "ffn_up.weight", (s.intermediate, s.hidden), False),
            (p + "ffn_down.weight", (s.hidden, s.intermediate), False),
        ]
    plan.append(("output_norm.weight", (s.hidden,), True))
    if not s.tied:
        plan.append(("output.weight", (s.vocab, s.hidden), False))
    return plan


def copy_tokenizer_fields(reader: GGUFReader, writer: GGUFWriter) -> int:
    n = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), vtype)
        n += 1
    return n


def make_tensor(rng: np.random.Generator, shape: tuple[int, ...], is_norm: bool, std: float) -> np.ndarray:
    if is_norm:
        return np.ones(shape, dtype=np.float32)
    a = rng.standard_normal(shape, dtype=np.float32)
    a *= std
    return a


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", help="output .gguf path (keep it out of the repository, e.g. /tmp/real-shapes/)")
    ap.add_argument("--type", choices=("f16", "q8_0"), default="f16", help="weight type of the 2-D tensors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument(
        "--source", default=None, help="GGUF whose tokenizer.* metadata is copied (default: pagedllm's default model)"
    )
    args = ap.parse_args(argv)

    s = SHAPES[args.shape]
    src = args.source or default_source()
    reader = GGUFReader(src)
    src_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if src_vocab != s.vocab:
        raise SystemExit(f"{src} has {src_vocab} tokens, the shape wants {s.vocab}")
    qtype = GGMLQuantizationType.F16 if args.type == "f16" else GGMLQuantizationType.Q8_0
    file_type = gguf.LlamaFileType.MOSTLY_F16 if args.type == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0

    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    w = GGUFWriter(args.out, "llama", use_temp_file=False)
    w.add_type("model")
    w.add_name(s.name)
    w.add_basename("random-" + args.shape)
    w.add_size_label(s.size_label)
    w.add_description(
        f"random normal(0, {args.std}) weights, seed {args.seed}, pagedllm benchmarks/real_shapes/make_gguf.py; "
        f"tokenizer from {os.path.basename(src)}"
    )
    head_dim = s.hidden // s.heads
    w.add_vocab_size(s.vocab)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    n_tok = copy_tokenizer_fields(reader, w)
    del reader

    plan = tensor_plan(s)
    n_params = 0
    for name, shape, is_norm in plan:
        n_params += int(np.prod(shape))
        if is_norm:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor_info(name, shape, np.dtype(np.float16), 2 * int(np.prod(shape)))
        else:
            bshape = gguf.quant_shape_to_byte_shape(shape, qtype)
            w.add_tensor_info(name, bshape, np.dtype(np.uint8), int(np.prod(bshape)), raw_dtype=qtype)
    print(
        f"{args.shape}: {len(plan)} tensors, {n_params / 1e9:.3f}B parameters, {args.type}, "
        f"{n_tok} tokenizer fields from {src}",
        flush=True,
    )

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    for i, (name, shape, is_norm) in enumerate(plan):
        rng = np.random.default_rng([args.seed, i])
        a = make_tensor(rng, shape, is_norm, args.std)
        if not is_norm:
            a = a.astype(np.float16) if qtype == GGMLQuantizationType.F16 else gguf.quants.quantize(a, qtype)
        w.write_tensor_data(a)
        del a
        if i % 20 == 0 or i == len(plan) - 1:
            print(f"  [{i + 1}/{len(plan)}] {name} {shape} ({time.perf_counter() - t0:.0f} s)", flush=True)
    w.close()
    print(f"wrote {args.out}: {os.path.getsize(args.out) / 1e9:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
