"""What a checkpoint hands a layer's weight loader: a float tensor, or rows of GGUF blocks.

Every weight reaches its layer whole (the checkpoint's tensor under its Hugging Face name), and
the layer keeps its tensor-parallel shard of it: whole rows for a column-parallel layer, a range
of input columns for a row-parallel one. These helpers cut either kind the same way.

A GGUF matrix stays in the file's quantized blocks (``BlockRows``) until its layer decides how it
runs: rows of self-contained blocks (each carries its own scales), so a shard is made of whole
blocks of the file, never requantized. Rows move as they are; input columns must start and end on
block boundaries (32 values for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, 256 for the K-quants:
gguf's GGML_QUANT_SIZES). The integer kernels quantize the activations in blocks of 32 too, so a
rank's partial sum is exactly those blocks' terms of the full dot product; only the order of the
fp32 additions (the all-reduce) differs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


@dataclass
class BlockRows:
    """A GGUF matrix in torch's [out, in] order: ``data`` [N, row_bytes] uint8 (a view of the
    file's memory map until a layer copies it), ``k`` values per row, ``name`` as in the file."""

    name: str
    qtype: int
    data: np.ndarray
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.k)

    def numel(self) -> int:
        return self.data.shape[0] * self.k

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)][0]

    @property
    def format(self) -> str:
        return GGMLQuantizationType(self.qtype).name

    def take_rows(self, index: slice | np.ndarray) -> BlockRows:
        return replace(self, data=self.data[index])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float values [N, k] (gguf-py's dequantizer)."""
        from gguf.quants import dequantize

        w = dequantize(np.ascontiguousarray(self.data), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(-1, self.k)).to(dtype)

    def bytes_tensor(self) -> torch.Tensor:
        """The rows' bytes as a tensor of its own (the memory map is not kept)."""
        return torch.from_numpy(np.array(self.data, copy=True))


CheckpointTensor = torch.Tensor | BlockRows


def column_split_refusal(name: str, qtype: int, k: int, world_size: int) -> str | None:
    """Why ``k`` input columns of a tensor in ``qtype`` cannot be split over ``world_size`` ranks
    in whole blocks, or None."""
    block = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]
    if k % world_size == 0 and (k // world_size) % block == 0:
        return None
    return (
        f"GGUF tensor {name} ({GGMLQuantizationType(qtype).name}, block size {block}): its {k} input columns "
        f"do not split over {world_size} ranks in whole {block}-value blocks ({k / world_size:g} per rank)"
    )


def rows_of(t: CheckpointTensor, index: slice | torch.Tensor) -> CheckpointTensor:
    """Rows ``index`` of a weight (or elements of a bias)."""
    if isinstance(t, BlockRows):
        return t.take_rows(index if isinstance(index, slice) else index.numpy())
    return t[index]


def columns_of(t: CheckpointTensor, cols: slice, world_size: int) -> CheckpointTensor:
    """Input columns ``cols`` of a weight: of GGUF blocks only whole ones, else a ValueError
    naming the tensor (dequantizing it instead would quietly multiply its memory and per-step
    reads, ~5x for Q6_K: the caller's choice, quantization=None)."""
    if not isinstance(t, BlockRows):
        return t[:, cols]
    refusal = column_split_refusal(t.name, t.qtype, t.k, world_size)
    if refusal is not None:
        raise ValueError(
            f"tensor_parallel_size={world_size}: {refusal}; use a tensor_parallel_size that splits it, "
            "or quantization=None to dequantize the file at load"
        )
    per_block = t.data.shape[1] // (t.k // t.block_size)  # bytes of a block
    first, last = cols.start // t.block_size, cols.stop // t.block_size
    return replace(t, data=t.data[:, first * per_block : last * per_block], k=cols.stop - cols.start)


def padded_rows(t: CheckpointTensor, start: int, rows: int) -> CheckpointTensor:
    """Rows [start, start + rows), zero rows past the end (a vocabulary shard of the last rank):
    zero bytes are blocks of scale 0 in every GGUF format (values 0), and no id ever looks
    them up or wins the argmax."""
    part = rows_of(t, slice(start, start + rows))
    missing = rows - part.shape[0]
    if missing == 0:
        return part
    if isinstance(part, BlockRows):
        pad = np.zeros((missing, part.data.shape[1]), part.data.dtype)
        return replace(part, data=np.concatenate([part.data, pad]))
    return torch.cat([part, part.new_zeros((missing, *part.shape[1:]))])
