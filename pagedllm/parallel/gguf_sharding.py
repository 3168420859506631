"""Cuts a GGUF file's tensors to one rank's shard in their quantized blocks, before the layers
holding them are built (so before the kernels repack any rows).

A GGUF matrix is rows of self-contained blocks (each block carries its own scales), so a shard
is made of whole blocks of the file, never requantized:
- column-parallel (q/k/v, gate/up, the vocabulary rows of the embedding and the head): whole
  rows, sliced as they are;
- row-parallel (o_proj, down_proj): a contiguous range of input columns, which must start and end
  on block boundaries (32 values for Q4_0 / Q4_1 / Q8_0, 256 for the K-quants: gguf's
  GGML_QUANT_SIZES). The integer kernels quantize the activations in blocks of 32 too, so a rank's
  blocks of activations are the full row's, and its partial sum is exactly those blocks' terms of
  the full dot product; only the order of the fp32 additions (the all-reduce) differs.
A shape that does not split so is refused, naming the tensor: dequantizing that tensor instead
would quietly multiply its memory and its per-step reads (e.g. ~5x for Q6_K), which the caller
should choose (quantization=None, or another tensor_parallel_size).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedllm.parallel.sharding import LlamaShard

# the row-parallel weights of a layer (HF names under model.layers.N.)
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


class FileTensor(Protocol):
    """A tensor of the file as loader_gguf_native holds it: ``data`` [N, row units] (bytes of
    blocks, or plain numbers) or [N], ``k`` values per row, ``name`` as in the file."""

    name: str
    qtype: int
    data: np.ndarray
    k: int


def block_split_refusal(name: str, qtype: int, k: int, world_size: int) -> str | None:
    """Why ``k`` input columns of a tensor in ``qtype`` cannot be split over ``world_size`` ranks
    in whole blocks, or None."""
    block = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]
    if k % world_size == 0 and (k // world_size) % block == 0:
        return None
    return (
        f"GGUF tensor {name} ({GGMLQuantizationType(qtype).name}, block size {block}): its {k} input columns "
        f"do not split over {world_size} ranks in whole {block}-value blocks ({k / world_size:g} per rank)"
    )


def _rows(t: FileTensor, rows: slice) -> None:
    t.data = np.ascontiguousarray(t.data[rows])


def _columns(t: FileTensor, cols: slice, world_size: int) -> None:
    refusal = block_split_refusal(t.name, t.qtype, t.k, world_size)
    if refusal is not None:
        raise ValueError(
            f"tensor_parallel_size={world_size}: {refusal}; use a tensor_parallel_size that splits it, "
            "or quantization=None to dequantize the file at load"
        )
    block = GGML_QUANT_SIZES[GGMLQuantizationType(t.qtype)][0]
    units_per_block = t.data.shape[1] // (t.k // block)  # bytes of a block, or 1 for plain numbers
    t.data = np.ascontiguousarray(
        t.data[:, cols.start // block * units_per_block : cols.stop // block * units_per_block]
    )
    t.k = cols.stop - cols.start


def _vocab_rows(t: FileTensor, start: int, rows: int) -> None:
    """Rows [start, start + rows), zero rows past the vocabulary: zero bytes are blocks of scale
    0 in every format (values 0), and no id ever looks them up or wins the argmax."""
    part = t.data[start : start + rows]
    pad = np.zeros((rows - part.shape[0], *part.shape[1:]), part.dtype)
    t.data = np.ascontiguousarray(np.concatenate([part, pad]))


def shard_gguf_tensors(tensors: dict[str, FileTensor], shard: LlamaShard, num_layers: int, world_size: int) -> None:
    """Replaces each tensor's data (HF names, HF row order) by ``shard``'s part, in place."""

    def rows(name: str, s: slice) -> None:
        if name in tensors:  # biases are optional
            _rows(tensors[name], s)

    for i in range(num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            rows(p + f"self_attn.q_proj.{kind}", shard.q_rows)
            rows(p + f"self_attn.k_proj.{kind}", shard.kv_rows)
            rows(p + f"self_attn.v_proj.{kind}", shard.kv_rows)
            rows(p + f"mlp.gate_proj.{kind}", shard.inter_rows)
            rows(p + f"mlp.up_proj.{kind}", shard.inter_rows)
        _columns(tensors[p + "self_attn.o_proj.weight"], shard.q_rows, world_size)
        _columns(tensors[p + "mlp.down_proj.weight"], shard.inter_rows, world_size)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            _vocab_rows(tensors[name], shard.vocab_start, shard.vocab_rows)
