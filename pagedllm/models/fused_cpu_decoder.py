"""The fused CPU decoder loop of the Llama-family models: bf16 and float32 forwards through the
compiled layer kernels (pagedllm.kernels), and float32 decode-only steps in one C++ call.

Its own module because it is a second way to run LlamaForCausalLM's layers, not part of their
definition: ``enable_fused_decoder`` resolves the layers into what the loop needs once (the model's
``enable_cpu_kernels`` calls it), ``forward_fused`` runs a step (the model's ``forward`` calls it
once kernels are enabled). The state it keeps lives on the model (``kernels``, ``_fused_layers``,
``_decoder_plan``), so the model's methods stay its public interface.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged_attention import attend
from pagedllm.kernels.interface import CpuKernels, layer_scales
from pagedllm.layers.linear import ParallelLinear

if TYPE_CHECKING:  # llama.py imports this module
    from pagedllm.models.llama import LlamaForCausalLM, RMSNorm

logger = logging.getLogger("pagedllm")


class _FusedLayer(NamedTuple):
    """One decoder layer, resolved for the fused CPU loop (forward_fused)."""

    qkv: Callable[[torch.Tensor], torch.Tensor]
    q_norm: RMSNorm | None  # per-head q / k norms before RoPE (Qwen3), or None
    k_norm: RMSNorm | None
    o_proj: Callable[[torch.Tensor], torch.Tensor]
    gate_up_silu_mul: Callable[[torch.Tensor], torch.Tensor]  # h -> silu(gate) * up
    down_proj: Callable[[torch.Tensor], torch.Tensor]
    post_norm_w: torch.Tensor
    post_norm_eps: float
    next_norm_w: torch.Tensor  # the next layer's input norm, or the final norm after the last layer
    next_norm_eps: float
    window: int | None  # the layer's sliding attention window (None: the whole context)


def _call(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The cheapest call of a parallel linear layer: its local GEMM where it does not all-reduce
    (at batch size 1 a step makes ~120 of these calls; a wrapper call each was measurable)."""
    if isinstance(layer, ParallelLinear) and not getattr(layer, "reduces", False):
        return layer.local.forward
    return layer.forward


def _gate_up_silu_mul(gate_up_proj: nn.Module, kernels: CpuKernels) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's silu(gate) * up: in the GEMM's epilogue where the layer fuses it, else a kernel after."""
    local = gate_up_proj.local
    if getattr(local, "fused_silu_mul", False):
        return local.silu_and_mul
    gemm = local.forward
    return lambda h: kernels.silu_and_mul(gemm(h))


def _linear_parts(module: nn.Module) -> list[tuple[torch.Tensor, int, torch.Tensor | None]] | None:
    """A projection as DecoderPlan takes it (parts whose outputs are concatenated), or None when
    some part is a layer the plan cannot run (packed bf16, a GGUF format without a kernel)."""
    from pagedllm.models.quantized_linear import ConcatLinear, QuantizedLinear

    if isinstance(module, ParallelLinear):
        return None if getattr(module, "reduces", False) else _linear_parts(module.local)
    if isinstance(module, ConcatLinear):
        parts = [_linear_parts(p) for p in module.parts]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]
    if isinstance(module, QuantizedLinear):
        if module.kernels is None or (module.bias is not None and module.bias.dtype != torch.float32):
            return None
        return [(module.qweight, module.kernel_qtype, module.bias)]
    if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
        return [(module.weight, -1, module.bias)]
    return None


def enable_fused_decoder(model: LlamaForCausalLM, kernels: CpuKernels | None) -> bool:
    """Runs bf16 and float32 CPU forwards through the fused kernels (pagedllm.kernels); False
    if not applicable. Any linear layer will do (float, packed, GGUF-quantized): the kernels
    take the activations between them."""
    dtype = model.activation_dtype()
    norms = [model.norm] + [
        n
        for layer in model.layers
        for n in (
            layer.input_layernorm,
            layer.post_attention_layernorm,
            layer.self_attn.q_norm,
            layer.self_attn.k_norm,
        )
        if n is not None
    ]
    if (
        kernels is None
        or dtype not in (torch.bfloat16, torch.float32)
        or any(n.weight.dtype != dtype or n.weight.device.type != "cpu" for n in norms)
    ):
        return False
    refusal = kernels.layer_ops_refusal(dtype, model.num_heads, model.num_kv_heads, model.head_dim)
    if refusal is not None:
        # Decided here, once: the kernel would refuse every step of this model otherwise.
        logger.warning("pagedllm: the fused layer kernels do not take %s; the layers run the PyTorch path", refusal)
        return False
    model.kernels = kernels
    # Everything the fused loop needs, looked up once: at batch size 1 a step is ~120 small
    # kernels, and nn.Module call / attribute overhead was a quarter of it.
    norms = [layer.post_attention_layernorm for layer in model.layers]
    next_norms = [layer.input_layernorm for layer in model.layers[1:]] + [model.norm]
    model._fused_layers = [
        _FusedLayer(
            _call(layer.self_attn.qkv_proj),
            layer.self_attn.q_norm,
            layer.self_attn.k_norm,
            _call(layer.self_attn.o_proj),
            _gate_up_silu_mul(layer.mlp.gate_up_proj, kernels),
            _call(layer.mlp.down_proj),
            post.weight,
            post.eps,
            nxt.weight,
            nxt.eps,
            layer.self_attn.window,
        )
        for layer, post, nxt in zip(model.layers, norms, next_norms, strict=True)
    ]
    model._decoder_plan = _build_decoder_plan(model, kernels, norms, next_norms) if dtype == torch.float32 else None
    return True


def _build_decoder_plan(model: LlamaForCausalLM, kernels: CpuKernels, norms: list[RMSNorm], next_norms: list[RMSNorm]):
    """The whole-step decode loop (decoder_loop.cpp) for this model, or None where some layer
    is one it cannot run: then every step takes the fused Python loop."""
    if model.qk_norm:
        # The plan has no q/k norm step: running it would skip the norms. The fused Python
        # loop applies them, so every step of such a model runs there.
        return None
    if model.tensor_parallel_size > 1:
        # The C++ loop cannot all-reduce between a row-parallel projection and the residual
        # add; the fused Python loop calls the layers, which do.
        return None
    projections = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            parts = _linear_parts(module)
            if parts is None:
                return None
            projections.append(parts)
    weights, eps = [], []
    for post, nxt in zip(norms, next_norms, strict=True):
        weights += [post.weight.detach(), nxt.weight.detach()]
        eps += [post.eps, nxt.eps]
    attn = model.layers[0].self_attn
    windows = [layer.self_attn.window for layer in model.layers]
    return kernels.decoder_plan(
        projections, weights, eps, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, windows
    )


def forward_fused(
    model: LlamaForCausalLM,
    x: torch.Tensor,
    rope_rows: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """vLLM's layer shape: one residual stream updated in place, each RMSNorm fused with the
    residual add before it (the reference computes the same sums, see llama.py's DecoderLayer). RoPE
    and the KV-cache write are one pass over the qkv projection, in place; attention reads q from it.
    ``rope_rows``: each token's row of the cos/sin tables (RotaryEmbedding.table_rows), which
    is all the kernels use positions for."""
    kernels = model.kernels
    attn = model.layers[0].self_attn
    nh, nkv, d, scale = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale
    qs, kvs = attn.q_size, attn.kv_size
    cos, sin = model.rope.kernel_tables(x.dtype)
    slots = meta.slot_mapping
    t = x.shape[0]
    residual = x  # the embedding lookup made a fresh tensor: safe to update in place
    h = model.layers[0].input_layernorm(x)
    plan = model._decoder_plan
    if plan is not None and meta.decode_kernel is not None and (not meta.prefills or meta.prefill_as_decode_rows):
        # Every row a decode, or attended as one (float32 prefill rows, e.g. the verifying pass of
        # speculative decoding): the same kernels as the loop below, from one C++ call. Each row's
        # attention depends on its own keys alone, so one call over all rows gives the bits of the
        # loop's two (decode rows, then prefill rows).
        tables, lens = meta.rows_as_decodes()
        return plan.decode(h, residual, rope_rows, cos, sin, kv_caches, layer_scales(kv_caches), slots, tables, lens)
    for lyr, (k_cache, v_cache) in zip(model._fused_layers, kv_caches, strict=True):
        qkv = lyr.qkv(h)
        if lyr.q_norm is not None:
            # in place on the fresh qkv rows, before the kernel rotates q and k and caches k
            q = qkv[:, :qs].view(t, nh, d)
            k = qkv[:, qs : qs + kvs].view(t, nkv, d)
            q.copy_(lyr.q_norm(q))
            k.copy_(lyr.k_norm(k))
        kernels.rope_and_cache_write(qkv, rope_rows, cos, sin, k_cache, v_cache, slots, nh, nkv)
        q = qkv[:, :qs].view(t, nh, d)
        k = qkv[:, qs : qs + kvs].view(t, nkv, d)
        v = qkv[:, qs + kvs :].view(t, nkv, d)
        o = attend(q, k, v, k_cache, v_cache, meta, scale, lyr.window)
        h = kernels.add_rms_norm(lyr.o_proj(o.view(t, qs)), residual, lyr.post_norm_w, lyr.post_norm_eps)
        m = lyr.down_proj(lyr.gate_up_silu_mul(h))
        h = kernels.add_rms_norm(m, residual, lyr.next_norm_w, lyr.next_norm_eps)
    return h
