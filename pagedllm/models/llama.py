"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Numerics follow Hugging Face transformers (RMSNorm in fp32, RoPE tables from transformers' own
rope-init functions: models/rope.py) so greedy output matches it token for token in fp32. q/k/v
and gate/up projections are fused into one matmul each: fewer, larger GEMMs are faster on every
device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged_attention import attend, paged_attention, timing_attention
from pagedllm.kernels.interface import CpuKernels
from pagedllm.models.attention_windows import layer_windows
from pagedllm.models.rope import RotaryEmbedding, apply_rope
from pagedllm.models.weight_copy import check_all_loaded, copy_weight

logger = logging.getLogger("pagedllm")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # transformers' exact formula, so fp32 output matches it bit for bit where it can
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x
        # low precision: one fused kernel (fp32 accumulation inside) instead of five ops
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    """``qk_norm``: RMSNorm over each head of q and k after the projection, before RoPE (Qwen3)."""

    def __init__(self, cfg, qkv_bias: bool, qk_norm: bool = False, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # sliding attention window of this layer (None: the whole context)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False))
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], k_cache, v_cache, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, *rope)
        o = paged_attention(q, k, v.contiguous(), k_cache, v_cache, meta, self.scale, self.window)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=bias)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not supported")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, qkv_bias: bool, qk_norm: bool = False, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qkv_bias, qk_norm, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class _FusedLayer(NamedTuple):
    """One decoder layer, resolved for the fused CPU loop (LlamaForCausalLM._forward_fused)."""

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


def _gate_up_silu_mul(gate_up_proj: nn.Module, kernels: CpuKernels) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's silu(gate) * up: in the GEMM's epilogue where the layer fuses it, else a kernel after."""
    if getattr(gate_up_proj, "fused_silu_mul", False):
        return gate_up_proj.silu_and_mul
    return lambda h: kernels.silu_and_mul(gate_up_proj(h))


def _linear_parts(module: nn.Module) -> list[tuple[torch.Tensor, int, torch.Tensor | None]] | None:
    """A projection as DecoderPlan takes it (parts whose outputs are concatenated), or None when
    some part is a layer the plan cannot run (packed bf16, a GGUF format without a kernel)."""
    from pagedllm.models.quantized_linear import ConcatLinear, QuantizedLinear

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


class LlamaForCausalLM(nn.Module):
    """The decoder over a flat batch: ``forward(input_ids[T], positions[T], kv_caches, meta)``."""

    qkv_bias_default = False
    qk_norm = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    # fused [gate; up] projections whose packed bf16 GEMM may apply silu(gate) * up in its epilogue
    silu_mul_projections: tuple[str, ...] = ("gate_up_proj",)
    rope_class: type[RotaryEmbedding] = RotaryEmbedding
    tensor_parallel_size = 1  # ranks this model is a shard of (set by parallel/sharding.py)

    def __init__(self, hf_config, max_model_len: int) -> None:
        super().__init__()
        cfg = hf_config
        self.config = cfg
        qkv_bias = getattr(cfg, "attention_bias", self.qkv_bias_default) or self.qkv_bias_default
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, qkv_bias, self.qk_norm, window) for window in layer_windows(cfg))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = self.rope_class(cfg, max(max_model_len, getattr(cfg, "max_position_embeddings", 0)))
        # A head object compute_logits / greedy_tokens call instead of F.linear: PackedLinear
        # (bf16 CPU) or VocabParallelHead (a tensor-parallel shard); None: the plain matmul.
        self.packed_head = None
        self.kernels: CpuKernels | None = None  # compiled CPU kernels of the fused path (enable_cpu_kernels)
        self._decoder_plan = None  # float32 decode-only steps in one kernel call (enable_cpu_kernels)
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def activation_dtype(self) -> torch.dtype:
        """dtype of the hidden states: the embedding's output. A QuantizedEmbedding (native GGUF)
        has no float weight; it says its output dtype itself."""
        emb = self.embed_tokens
        if isinstance(emb, nn.Embedding):
            return emb.weight.dtype
        return getattr(emb, "dtype", self.norm.weight.dtype)

    def enable_cpu_kernels(self, kernels: CpuKernels | None) -> bool:
        """Runs bf16 and float32 CPU forwards through the fused kernels (pagedllm.kernels); False
        if not applicable. Any linear layer will do (float, packed, GGUF-quantized): the kernels
        take the activations between them."""
        dtype = self.activation_dtype()
        norms = [self.norm] + [
            n
            for layer in self.layers
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
        refusal = kernels.layer_ops_refusal(dtype, self.num_heads, self.num_kv_heads, self.head_dim)
        if refusal is not None:
            # Decided here, once: the kernel would refuse every step of this model otherwise.
            logger.warning("pagedllm: the fused layer kernels do not take %s; the layers run the PyTorch path", refusal)
            return False
        self.kernels = kernels
        # Everything the fused loop needs, looked up once: at batch size 1 a step is ~120 small
        # kernels, and nn.Module call / attribute overhead was a quarter of it.
        norms = [layer.post_attention_layernorm for layer in self.layers]
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        self._fused_layers = [
            _FusedLayer(
                layer.self_attn.qkv_proj.forward,
                layer.self_attn.q_norm,
                layer.self_attn.k_norm,
                layer.self_attn.o_proj.forward,
                _gate_up_silu_mul(layer.mlp.gate_up_proj, kernels),
                layer.mlp.down_proj.forward,
                post.weight,
                post.eps,
                nxt.weight,
                nxt.eps,
                layer.self_attn.window,
            )
            for layer, post, nxt in zip(self.layers, norms, next_norms, strict=True)
        ]
        self._decoder_plan = self._build_decoder_plan(kernels, norms, next_norms) if dtype == torch.float32 else None
        return True

    def _build_decoder_plan(self, kernels: CpuKernels, norms: list[RMSNorm], next_norms: list[RMSNorm]):
        """The whole-step decode loop (decoder_loop.cpp) for this model, or None where some layer
        is one it cannot run: then every step takes the fused Python loop."""
        if self.qk_norm:
            # The plan has no q/k norm step: running it would skip the norms. The fused Python
            # loop applies them, so every step of such a model runs there.
            return None
        if self.tensor_parallel_size > 1:
            # The C++ loop cannot all-reduce between a row-parallel projection and the residual
            # add; the fused Python loop calls the layers, which do.
            return None
        projections = []
        for layer in self.layers:
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
        attn = self.layers[0].self_attn
        windows = [layer.self_attn.window for layer in self.layers]
        return kernels.decoder_plan(
            projections, weights, eps, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, windows
        )

    def forward(self, input_ids, positions, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta):
        x = self.embed_tokens(input_ids)
        rope_rows = self.rope.table_rows(positions, meta)
        if self.kernels is not None:
            return self._forward_fused(x, rope_rows, kv_caches, meta)
        rope = self.rope.tables(rope_rows, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, k_cache, v_cache, meta)
        return self.norm(x)

    def _forward_fused(self, x, rope_rows, kv_caches, meta: AttentionMetadata):
        """vLLM's layer shape: one residual stream updated in place, each RMSNorm fused with the
        residual add before it (the reference computes the same sums, see DecoderLayer). RoPE and
        the KV-cache write are one pass over the qkv projection, in place; attention reads q from it.
        ``rope_rows``: each token's row of the cos/sin tables (RotaryEmbedding.table_rows), which
        is all the kernels use positions for."""
        kernels = self.kernels
        attn = self.layers[0].self_attn
        nh, nkv, d, scale = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale
        qs, kvs = attn.q_size, attn.kv_size
        cos, sin = self.rope.kernel_tables(x.dtype)
        slots = meta.slot_mapping
        t = x.shape[0]
        residual = x  # the embedding lookup made a fresh tensor: safe to update in place
        h = self.layers[0].input_layernorm(x)
        plan = self._decoder_plan
        if plan is not None and not meta.prefills and meta.decode_kernel is not None and not timing_attention():
            # Every row a decode: the same kernels as the loop below, from one C++ call.
            return plan.decode(
                h,
                residual,
                rope_rows,
                cos,
                sin,
                kv_caches,
                slots,
                meta.decode_block_tables,
                meta.decode_seq_lens,
            )
        for lyr, (k_cache, v_cache) in zip(self._fused_layers, kv_caches, strict=True):
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler widens them only when it has to)."""
        if self.packed_head is not None:
            return self.packed_head(hidden)
        w = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, w)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax of compute_logits(hidden) per row, without the logits (a greedy-only step's
        [rows, vocab] logits are most of the head's time to write and read back); None when
        only compute_logits serves here."""
        return self.packed_head.argmax(hidden) if self.packed_head is not None else None

    def pack_for_cpu(self, kernels: CpuKernels | None = None) -> int:
        """Lays bf16 matmul weights out for the CPU kernels (see cpu_linear); returns the layers
        packed. ``kernels``: the compiled CPU kernels (packed_gemm), or None for oneDNN."""
        from pagedllm.models.cpu_linear import pack_linears, packed_lm_head, place_on_huge_pages

        packed = pack_linears(self.layers, kernels, fuse_silu_mul_names=self.silu_mul_projections)
        if packed:
            w = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
            self.packed_head = packed_lm_head(w, kernels)
            packed.append(self.packed_head)
            place_on_huge_pages(packed)
        return len(packed)

    def init_computed_buffers(self, device: torch.device) -> None:
        """RoPE tables are computed, not loaded, and stay fp32 (cast per use, as transformers does)."""
        self.rope = type(self.rope)(self.config, self.rope.max_len).to(device)

    # ---- weights -------------------------------------------------------------------------
    def load_hf_weights(self, tensors) -> None:
        """Copies Hugging Face-named tensors (an iterable of (name, tensor)) into the fused layout."""
        own = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded = set()
        for name, t in tensors:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts = name.split(".")
            if len(parts) >= 3 and parts[-2] in fused:
                target, idx = fused[parts[-2]]
                key = ".".join(parts[:-2] + [target, parts[-1]])
                pending.setdefault(key, {})[idx] = t
                n_parts = 3 if target == "qkv_proj" else 2
                if len(pending[key]) == n_parts:
                    parts_by_idx = pending.pop(key)
                    t = torch.cat([parts_by_idx[i] for i in range(n_parts)], dim=0)
                    name = key
                else:
                    continue
            copy_weight(own, name, t)
            loaded.add(name)
        check_all_loaded(own, loaded, pending)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen2's decoder without the q/k/v biases (unless attention_bias), with q_norm / k_norm."""

    qk_norm = True
