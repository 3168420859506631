"""Loads a GGUF file with its weights left in their quantized blocks (any family of gguf_arch).

The file is read with gguf-py's memory-mapped reader one tensor at a time: quantized matrices
(Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K) become QuantizedLinear / QuantizedEmbedding layers
holding the file's bytes, float tensors (norms, F32 / F16 / BF16 matrices) load as floats. No float
copy of such a matrix is ever made. A tensor in a block format without an integer kernel (Q5_0,
Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS ...: llama.cpp's K-quant mixes hold Q5_0 / Q8_0 tensors wherever
a row is not a multiple of 256) loads dequantized to float, named in one log line. Config and
tokenizer come from the metadata-only conversion (``resolve_model_path(..., weights=False)``).

Two llama.cpp conventions are undone on the blocks, exactly:
- Llama's q/k rows are permuted (llama.cpp rotates adjacent pairs, HF the two halves of a head;
  families on NEOX RoPE, as Qwen2/3, are not permuted). The permutation moves whole rows, and a row
  is a whole number of blocks, so permuting the rows of the [N, row_bytes] byte array is the same
  permutation of the values;
- q/k/v and gate/up are separate tensors; the model runs them fused, so their rows are concatenated
  (same format), or kept as parts of a ConcatLinear (mixed formats).
"""

from __future__ import annotations

import functools
import logging
import re

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from torch import nn

from pagedllm.kernels.interface import CpuKernels
from pagedllm.models.gguf_arch import GGUFArchitecture, gguf_architecture
from pagedllm.models.gguf_tensors import GGUFIndex, read_gguf_index
from pagedllm.models.quantized_linear import QUANTIZED_TYPES, ConcatLinear, QuantizedEmbedding, QuantizedLinear
from pagedllm.models.registry import get_model_class

logger = logging.getLogger(__name__)


class _Tensor:
    """One GGUF tensor in torch order: ``data`` [N, row_bytes] uint8 (quantized) or float [N, K] / [N];
    ``quantized``: kept in its blocks for the integer kernels (else loaded as floats, a block
    format without a kernel dequantized);
    ``name``: the file's. ``shift``: what llama.cpp's converter added to the float values (Gemma's norms: 1)."""

    def __init__(self, name: str, qtype: int, data: np.ndarray, k: int, shift: float = 0.0) -> None:
        self.name, self.qtype, self.data, self.k, self.shift = name, qtype, data, k, shift

    @property
    def numel(self) -> int:
        return self.k if self.data.ndim == 1 else self.data.shape[0] * self.k

    @property
    def quantized(self) -> bool:
        return self.qtype in QUANTIZED_TYPES

    def float_tensor(self, dtype: torch.dtype) -> torch.Tensor:
        from gguf.quants import dequantize

        # F32 / F16 / BF16, or a block format without an integer kernel
        w = dequantize(self.data, GGMLQuantizationType(self.qtype)).astype(np.float32, copy=False)
        if self.shift:  # in float32, before the cast to dtype
            w = w - np.float32(self.shift)
        return torch.from_numpy(np.array(w.reshape(self.data.shape[0], -1) if self.data.ndim > 1 else w)).to(dtype)


def _read(file_tensors: list, arch: GGUFArchitecture, n_head: int, n_kv: int) -> dict[str, _Tensor]:
    """``file_tensors``: gguf_tensors.GGUFTensor or GGUFReader's ReaderTensor (same fields)."""
    out: dict[str, _Tensor] = {}
    for t in file_tensors:
        if t.name in arch.config_tensors:  # config values (in config.json), not weights
            continue
        qtype = int(t.tensor_type)
        if qtype not in QUANTIZED_TYPES and t.tensor_type not in _FLOAT_TYPES and not _dequantizable(qtype):
            raise ValueError(
                f"GGUF tensor {t.name}: format {t.tensor_type.name} cannot be read (gguf cannot dequantize it)"
            )
        dims = tuple(int(d) for d in reversed(t.shape))  # ggml order [in, out] -> torch [out, in]
        data = t.data  # a view of the memory map
        if len(dims) == 2:
            data = data.reshape(dims[0], -1)
        data = arch.to_hf_rows(t.name, data, n_head, n_kv)  # whole rows: exact on the blocks' bytes
        out[arch.hf_name(t.name)] = _Tensor(t.name, qtype, data, dims[-1], arch.value_shift(t.name))
    return out


_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@functools.cache
def _dequantizable(qtype: int) -> bool:
    """Whether gguf-py dequantizes this block format (Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, ...):
    a tensor in a format without an integer kernel then loads as floats rather than failing."""
    from gguf.quants import dequantize

    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    try:
        dequantize(np.zeros((1, nbytes), dtype=np.uint8), GGMLQuantizationType(qtype))
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def _log_dequantized(tensors: dict[str, _Tensor]) -> None:
    """One line naming the tensors whose format has no integer kernel (dequantized at load), by
    kind: "Q5_0: 81 tensors (attn_k x18, attn_q x18, ...)"."""
    by_type: dict[str, dict[str, int]] = {}
    for t in tensors.values():
        if not t.quantized and t.qtype not in {int(f) for f in _FLOAT_TYPES}:
            kind = re.sub(r"^blk\.\d+\.", "", t.name).removesuffix(".weight")
            kinds = by_type.setdefault(GGMLQuantizationType(t.qtype).name, {})
            kinds[kind] = kinds.get(kind, 0) + 1
    if by_type:
        logger.warning(
            "pagedllm: no integer kernel for these tensors' formats; they load dequantized to float: %s",
            "; ".join(
                f"{fmt}: {sum(k.values())} tensors ({', '.join(f'{n} x{c}' for n, c in sorted(k.items()))})"
                for fmt, k in sorted(by_type.items())
            ),
        )


def _linear(parts: list[_Tensor], bias: torch.Tensor | None, dtype: torch.dtype, kernels: CpuKernels | None):
    """One (possibly fused) projection from its GGUF parts, rows in order."""
    k = parts[0].k
    if all(p.quantized for p in parts) and len({p.qtype for p in parts}) == 1:
        rows = np.concatenate([p.data for p in parts], axis=0) if len(parts) > 1 else np.array(parts[0].data)
        return QuantizedLinear(torch.from_numpy(rows), parts[0].qtype, k, bias, kernels)
    if not any(p.quantized for p in parts):
        w = torch.cat([p.float_tensor(dtype) for p in parts], dim=0)
        lin = nn.Linear(k, w.shape[0], bias=bias is not None, device="meta")
        lin.weight = nn.Parameter(w, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        return lin
    # mixed formats: one GEMM per part, the bias split along
    mods, start = [], 0
    for p in parts:
        n = p.data.shape[0]
        b = None if bias is None else bias[start : start + n]
        mods.append(_linear([p], b, dtype, kernels))
        start += n
    return ConcatLinear(mods)


def _embedding_and_head(model: nn.Module, emb: _Tensor, head: _Tensor, dtype: torch.dtype, kernels: CpuKernels | None):
    """The token embedding and the LM head (``head is emb`` when tied)."""
    if head is emb and emb.quantized:  # tied: one copy of the blocks, in the head's layout
        model.packed_head = QuantizedLinear(torch.from_numpy(np.array(emb.data)), emb.qtype, emb.k, None, kernels)
        lin = model.packed_head
        model.embed_tokens = QuantizedEmbedding(lin.qweight, emb.qtype, emb.k, lin.kernels, lin.interleaved)
        model.embed_tokens.dtype = dtype
        return
    if emb.quantized:
        model.embed_tokens = QuantizedEmbedding(torch.from_numpy(np.array(emb.data)), emb.qtype, emb.k, kernels)
        model.embed_tokens.dtype = dtype
    else:
        model.embed_tokens.weight = nn.Parameter(emb.float_tensor(dtype), requires_grad=False)
    if head.quantized:
        model.lm_head = model.packed_head = _linear([head], None, dtype, kernels)
    elif not model.tie_word_embeddings:
        model.lm_head.weight = nn.Parameter(head.float_tensor(dtype), requires_grad=False)


def _row_linear(t: _Tensor, bias: torch.Tensor | None, dtype: torch.dtype, kernels: CpuKernels | None, tp):
    """o_proj / down_proj; under tensor parallelism row-parallel (its bias added once, after the
    all-reduce of the ranks' partial products)."""
    if tp is None:
        return _linear([t], bias, dtype, kernels)
    from pagedllm.parallel.layers import RowParallelLinear

    return RowParallelLinear(_linear([t], None, dtype, kernels), None if bias is None else bias.to(dtype), tp)


def _vocab_parallel(model: nn.Module, shard, tp) -> None:
    """The embedding and head _embedding_and_head built over the shard's vocabulary rows, made
    vocabulary-parallel (parallel/layers.py); the head's layer, quantized or not, runs as before."""
    from pagedllm.parallel.layers import VocabParallelEmbedding, VocabParallelHead
    from pagedllm.parallel.sharding import set_shard_sizes

    emb = model.embed_tokens
    if isinstance(emb, nn.Embedding):  # a float weight set on the full-vocabulary meta layer
        emb = nn.Embedding.from_pretrained(emb.weight)
    if model.packed_head is not None:  # a QuantizedLinear (tied: the embedding reads its blocks)
        head = model.packed_head
    else:
        head = emb.weight if model.tie_word_embeddings else model.lm_head.weight
    if hasattr(model, "lm_head"):
        del model.lm_head  # compute_logits goes through the parallel head only
    vocab = model.config.vocab_size
    model.embed_tokens = VocabParallelEmbedding(emb, shard.vocab_start, vocab, tp)
    model.packed_head = VocabParallelHead(head, shard.vocab_start, vocab, tp)
    set_shard_sizes(model, shard, tp)


def _set_float_parameter(model: nn.Module, name: str, t: _Tensor, dtype: torch.dtype, gguf_path: str) -> None:
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        module = None
    current = getattr(module, leaf, None) if module is not None else None
    if not isinstance(current, nn.Parameter) or not current.is_meta or t.quantized:
        raise ValueError(f"{gguf_path}: unexpected tensor {name!r}")
    if tuple(current.shape) != tuple(t.data.shape):
        raise ValueError(
            f"{gguf_path}: tensor {name!r} has shape {tuple(t.data.shape)}, the model {tuple(current.shape)}"
        )
    setattr(module, leaf, nn.Parameter(t.float_tensor(dtype), requires_grad=False))


def _file_index(gguf_path: str) -> GGUFIndex:
    index = read_gguf_index(gguf_path)
    if index is None:  # a byte order or version gguf_tensors leaves to gguf-py
        reader = GGUFReader(gguf_path)
        field = reader.fields.get("general.architecture")
        index = GGUFIndex(None if field is None else field.contents(), reader.tensors)
    return index


def runs_natively(gguf_path: str) -> bool:
    """Whether the file's family loads in its quantized blocks (the Llama-like layers this loader
    builds); an unsupported family answers True, so that loading it names the supported ones."""
    try:
        return gguf_architecture(_file_index(gguf_path).architecture, gguf_path).llama_like
    except ValueError:
        return True


def tensor_parallel_refusal(gguf_path: str, world_size: int) -> str | None:
    """Why the file's row-parallel weights (o_proj, down_proj) do not split over ``world_size``
    ranks in whole quantization blocks, or None (parallel/gguf_sharding.py)."""
    from pagedllm.parallel.gguf_sharding import ROW_PARALLEL, block_split_refusal

    index = _file_index(gguf_path)
    arch = gguf_architecture(index.architecture, gguf_path)
    for t in index.tensors:
        if t.name not in arch.config_tensors and arch.hf_name(t.name).endswith(ROW_PARALLEL):
            refusal = block_split_refusal(t.name, int(t.tensor_type), int(t.shape[0]), world_size)
            if refusal is not None:
                return refusal
    return None


def load_gguf_model(
    gguf_path: str,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    kernels: CpuKernels | None = None,
    tensor_parallel=None,
) -> nn.Module:
    """The model of ``gguf_path`` with quantized weights kept quantized; ``dtype``: activations.
    ``tensor_parallel``: this rank's TensorParallelGroup: the file's tensors are cut to its shard
    in whole quantization blocks (parallel/gguf_sharding.py) before any layer is built."""
    if device.type != "cpu":
        raise ValueError("quantization='gguf' runs on the CPU only; use quantization=None to dequantize at load")
    cls = get_model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config, max_model_len)
    index = _file_index(gguf_path)
    arch = gguf_architecture(index.architecture, gguf_path)
    if not arch.llama_like:
        raise NotImplementedError(
            f"{gguf_path}: {index.architecture} GGUF files do not run natively (quantization='gguf'); "
            "quantization=None dequantizes them at load"
        )
    file_tensors = index.tensors
    tensors = _read(file_tensors, arch, hf_config.num_attention_heads, hf_config.num_key_value_heads)
    _log_dequantized(tensors)
    # what the whole model holds (not one shard), for FLOP-per-token figures as load_model counts
    file_params = sum(t.numel for t in tensors.values())
    shard = None
    if tensor_parallel is not None:
        from pagedllm.parallel.gguf_sharding import shard_gguf_tensors
        from pagedllm.parallel.sharding import llama_shard

        shard = llama_shard(model, tensor_parallel)
        shard_gguf_tensors(tensors, shard, len(model.layers), tensor_parallel.world_size)

    def take(name: str) -> _Tensor:
        if name not in tensors:
            raise ValueError(f"{gguf_path}: missing tensor for {name!r}")
        return tensors.pop(name)

    def float_bias(name: str) -> torch.Tensor | None:
        return take(name).float_tensor(torch.float32) if name in tensors else None

    # a model that runs its fused q/k/v rows in its own order (Phi-4-mini's partial RoPE): whole
    # rows move, so the byte rows of quantized blocks take the same order exactly
    qkv_order = model.qkv_row_order() if hasattr(model, "qkv_row_order") else None
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if qkv_order is not None:
            fused = tensors[p + "self_attn.qkv_proj.weight"]
            fused.data = fused.data[qkv_order.numpy()]
            bias = tensors.get(p + "self_attn.qkv_proj.bias")
            if bias is not None:
                bias.data = bias.data[qkv_order.numpy()]
        attn, mlp = layer.self_attn, layer.mlp
        # q/k/v and gate/up: one fused tensor (Phi-3) or separate ones (Llama-like), in that order
        qkv_names = ("qkv_proj",) if p + "self_attn.qkv_proj.weight" in tensors else ("q_proj", "k_proj", "v_proj")
        qkv = [take(p + f"self_attn.{n}.weight") for n in qkv_names]
        biases = [float_bias(p + f"self_attn.{n}.bias") for n in qkv_names]
        qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        attn.qkv_proj = _linear(qkv, qkv_bias, dtype, kernels)
        o_bias = float_bias(p + "self_attn.o_proj.bias")
        attn.o_proj = _row_linear(take(p + "self_attn.o_proj.weight"), o_bias, dtype, kernels, tensor_parallel)
        gate_up_names = ("gate_up_proj",) if p + "mlp.gate_up_proj.weight" in tensors else ("gate_proj", "up_proj")
        mlp.gate_up_proj = _linear([take(p + f"mlp.{n}.weight") for n in gate_up_names], None, dtype, kernels)
        mlp.down_proj = _row_linear(take(p + "mlp.down_proj.weight"), None, dtype, kernels, tensor_parallel)

    emb = take("model.embed_tokens.weight")
    head = emb if model.tie_word_embeddings else take("lm_head.weight")
    _embedding_and_head(model, emb, head, dtype, kernels)
    if shard is not None:
        _vocab_parallel(model, shard, tensor_parallel)
    # What is left are the float tensors of the family's norms (layer norms, the final norm,
    # Qwen3's per-head q/k norms ...): each goes to the model parameter of its HF name.
    for name, t in tensors.items():
        _set_float_parameter(model, name.removeprefix("model."), t, dtype, gguf_path)
    # the state dict leaves out the computed buffers (RoPE tables), which init_computed_buffers makes
    leftover = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if leftover:
        raise ValueError(f"{gguf_path}: weights not loaded: {leftover}")
    del file_tensors  # drop the memory map: every tensor kept was copied out of it

    model.init_computed_buffers(device)
    model.eval()
    model.requires_grad_(False)
    # what load_model counts (parameters before packing), for FLOP-per-token figures; the tied
    # head shares the embedding's blocks and is not counted twice
    model.num_params = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and not (m is model.packed_head and model.tie_word_embeddings):
            model.num_params += m.in_features * m.out_features + (0 if m.bias is None else m.bias.numel())
        elif isinstance(m, QuantizedEmbedding):
            model.num_params += m.qweight.shape[0] * m.dim
    if shard is not None:
        model.num_params = file_params
    # RoPE, the cache write, SiLU-and-mul and add + RMSNorm between the GEMMs: the fused kernels
    if kernels is not None:
        model.enable_cpu_kernels(kernels)
    formats = sorted({m.format for m in model.modules() if isinstance(m, QuantizedLinear)})
    n_kernel = sum(1 for m in model.modules() if isinstance(m, QuantizedLinear) and m.kernels is not None)
    n_quant = sum(1 for m in model.modules() if isinstance(m, QuantizedLinear))
    logger.info(
        "loaded %s natively from %s (%s; %d/%d quantized GEMMs on the integer kernel; activations %s)",
        cls.__name__,
        gguf_path,
        ", ".join(formats),
        n_kernel,
        n_quant,
        dtype,
    )
    return model
