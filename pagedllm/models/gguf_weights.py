"""The weights of a GGUF file as a stream of (Hugging Face name, tensor) for ``load_weights``.

The file is read through its memory map one tensor at a time (gguf_tensors.py). A matrix in a
block format with an integer kernel (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K;
llama.cpp's K-quant mixes hold Q5_0 / Q5_1 / Q8_0 tensors wherever a row is not a multiple of 256)
comes as ``BlockRows`` (the file's bytes; the layer that takes it keeps them, never a float copy); float
tensors (norms, F32 / F16 / BF16 matrices) come as float tensors. A tensor in a block format
without an integer kernel (Q2_K, Q3_K, IQ4_NL, IQ4_XS ...) comes dequantized to float, named in
one log line. Config and tokenizer come from the metadata-only conversion
(``resolve_model_path(..., weights=False)``).

What is GGUF's own stays here: the name map and the metadata (gguf_arch.py), and llama.cpp's
q/k row permutation for its adjacent-pair RoPE (Llama), undone exactly on whole rows, so on the
blocks' bytes too. Each layer then cuts its tensor-parallel shard of the whole tensor
(pagedllm.layers), as from any checkpoint.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from pagedllm.layers.checkpoint import BlockRows, CheckpointTensor, column_split_refusal
from pagedllm.models.gguf_arch import gguf_architecture
from pagedllm.models.gguf_tensors import GGUFIndex, read_gguf_index
from pagedllm.models.quantized_linear import QUANTIZED_TYPES

logger = logging.getLogger(__name__)

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@functools.cache
def _dequantizable(qtype: int) -> bool:
    """Whether gguf-py dequantizes this block format (Q2_K, Q3_K, IQ4_NL, IQ4_XS, ...):
    a tensor in a format without an integer kernel then loads as floats rather than failing."""
    from gguf.quants import dequantize

    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    try:
        dequantize(np.zeros((1, nbytes), dtype=np.uint8), GGMLQuantizationType(qtype))
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def _float_values(name: str, qtype: int, data: np.ndarray, shift: float) -> torch.Tensor:
    """A tensor's values as float32 (F32 / F16 / BF16, or a block format dequantized)."""
    from gguf.quants import dequantize

    w = dequantize(np.ascontiguousarray(data), GGMLQuantizationType(qtype)).astype(np.float32, copy=False)
    if shift:  # in float32, before any cast
        w = w - np.float32(shift)
    return torch.from_numpy(np.array(w.reshape(data.shape[0], -1) if data.ndim > 1 else w))


def _log_dequantized(counts: dict[str, dict[str, int]]) -> None:
    """One line naming the tensors whose format has no integer kernel (dequantized at load), by
    kind: "Q3_K: 36 tensors (attn_k x18, attn_q x18)"."""
    if counts:
        logger.warning(
            "pagedllm: no integer kernel for these tensors' formats; they load dequantized to float: %s",
            "; ".join(
                f"{fmt}: {sum(k.values())} tensors ({', '.join(f'{n} x{c}' for n, c in sorted(k.items()))})"
                for fmt, k in sorted(counts.items())
            ),
        )


def file_index(gguf_path: str) -> GGUFIndex:
    index = read_gguf_index(gguf_path)
    if index is None:  # a byte order or version gguf_tensors leaves to gguf-py
        reader = GGUFReader(gguf_path)
        field = reader.fields.get("general.architecture")
        index = GGUFIndex(None if field is None else field.contents(), reader.tensors)
    return index


def gguf_weights(gguf_path: str, hf_config, keep_blocks: bool = True) -> Iterator[tuple[str, CheckpointTensor]]:
    """(HF name, tensor) for every weight of the file, in HF's layout and row order.
    ``keep_blocks``: formats with an integer kernel come as BlockRows (else everything float32)."""
    index = file_index(gguf_path)
    arch = gguf_architecture(index.architecture, gguf_path)
    n_head = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_head
    dequantized: dict[str, dict[str, int]] = {}
    for t in index.tensors:
        if t.name in arch.config_tensors:  # config values (in config.json), not weights
            continue
        qtype = int(t.tensor_type)
        is_float = t.tensor_type in _FLOAT_TYPES
        if qtype not in QUANTIZED_TYPES and not is_float and not _dequantizable(qtype):
            raise ValueError(
                f"GGUF tensor {t.name}: format {t.tensor_type.name} cannot be read (gguf cannot dequantize it)"
            )
        dims = tuple(int(d) for d in reversed(t.shape))  # ggml order [in, out] -> torch [out, in]
        data = t.data  # a view of the memory map
        if len(dims) == 2:
            data = data.reshape(dims[0], -1)
        data = arch.to_hf_rows(t.name, data, n_head, n_kv)  # whole rows: exact on the blocks' bytes
        name = arch.hf_name(t.name)
        if keep_blocks and qtype in QUANTIZED_TYPES and len(dims) == 2:
            yield name, BlockRows(t.name, qtype, data, dims[-1])
            continue
        if not is_float:
            kind = re.sub(r"^blk\.\d+\.", "", t.name).removesuffix(".weight")
            kinds = dequantized.setdefault(t.tensor_type.name, {})
            kinds[kind] = kinds.get(kind, 0) + 1
        w = _float_values(t.name, qtype, data, arch.value_shift(t.name))
        yield name, torch.from_numpy(np.ascontiguousarray(arch.to_hf_layout(t.name, w.numpy())))
    if keep_blocks:
        _log_dequantized(dequantized)


def tensor_parallel_refusal(gguf_path: str, world_size: int) -> str | None:
    """Why the file's row-parallel weights (o_proj, down_proj) do not split over ``world_size``
    ranks in whole quantization blocks, or None."""
    index = file_index(gguf_path)
    arch = gguf_architecture(index.architecture, gguf_path)
    for t in index.tensors:
        if t.name in arch.config_tensors or int(t.tensor_type) not in QUANTIZED_TYPES:
            continue
        if arch.hf_name(t.name).endswith(arch.row_parallel):
            refusal = column_split_refusal(t.name, int(t.tensor_type), int(t.shape[0]), world_size)
            if refusal is not None:
                return refusal
    return None
