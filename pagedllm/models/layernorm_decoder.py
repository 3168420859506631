"""The decoder GPT-2 and OPT share: learned absolute positions, LayerNorm, biased projections, a
two-matmul MLP, a tied LM head, over a paged KV cache.

The families differ only in what their configs set (pre- or post-LN, a position offset, a
word-embedding width other than the hidden size, the activation, where the query is scaled) and
in their checkpoints' names and layouts: gpt2.py and opt.py turn both into a ``DecoderSpec`` and
own-named tensors; the math lives here once. Numerics follow transformers (nn.LayerNorm, the same
order of operations) so fp32 greedy output matches it token for token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged_attention import paged_attention
from pagedllm.kernels.interface import CpuKernels
from pagedllm.models.weight_copy import check_all_loaded, copy_weight

# transformers' activation names this decoder implements. "gelu_new" is the tanh approximation
# (GPT-2's), the same function as torch's approximate="tanh".
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclass(frozen=True)
class DecoderSpec:
    """One family's decoder, in the terms this module computes it in."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_layers: int
    ffn_dim: int
    max_positions: int  # learned position rows: the context the model can take
    position_offset: int  # row of position 0 in the position table (OPT: 2)
    embed_dim: int  # word-embedding width; != hidden_size: project_in / project_out around the layers
    activation: str
    norm_eps: float
    norm_affine: bool  # LayerNorms with weight and bias
    pre_norm: bool  # LayerNorm before attention / MLP (else after the residual add)
    final_norm: bool  # a LayerNorm after the last layer
    bias: bool  # biases on every projection of the layers
    prescale_query: bool  # q * scale before attention, attention at scale 1 (OPT's order)
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of the {self.num_heads} heads")


def check_activation(name: str, family: str) -> None:
    if name not in ACTIVATIONS:
        raise NotImplementedError(
            f"{family}: activation_function {name!r} is not supported (supported: {', '.join(sorted(ACTIVATIONS))})"
        )


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.num_heads = self.num_kv_heads = spec.num_heads
        self.head_dim = spec.hidden_size // spec.num_heads
        self.hidden_size = spec.hidden_size
        self.scale = self.head_dim**-0.5
        self.prescale_query = spec.prescale_query
        self.qkv_proj = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=spec.bias)
        self.o_proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=spec.bias)

    def forward(self, x: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        scale = self.scale
        if self.prescale_query:
            q, scale = q * self.scale, 1.0
        o = paged_attention(q, k.contiguous(), v.contiguous(), k_cache, v_cache, meta, scale)
        return self.o_proj(o.reshape(t, self.hidden_size))


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.fc1 = nn.Linear(spec.hidden_size, spec.ffn_dim, bias=spec.bias)
        self.fc2 = nn.Linear(spec.ffn_dim, spec.hidden_size, bias=spec.bias)
        self.act = ACTIVATIONS[spec.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.pre_norm = spec.pre_norm
        self.attn_norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, elementwise_affine=spec.norm_affine)
        self.self_attn = Attention(spec)
        self.mlp_norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, elementwise_affine=spec.norm_affine)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.self_attn(self.attn_norm(x), k_cache, v_cache, meta)
            return x + self.mlp(self.mlp_norm(x))
        # post-LN (OPT-350m): each sublayer's output added to its input, then normalised
        x = self.attn_norm(x + self.self_attn(x, k_cache, v_cache, meta))
        return self.mlp_norm(x + self.mlp(x))


class LearnedPositionDecoder(nn.Module):
    """``forward(input_ids[T], positions[T], kv_caches, meta)`` -> final hidden states [T, embed_dim].

    A family subclass sets ``family`` and ``make_spec`` (its config -> DecoderSpec) and implements
    ``own_tensors``: the checkpoint's tensors under this module's parameter names, in its layout
    (see load_hf_weights)."""

    family = "decoder"  # the family's name in messages
    make_spec: Callable[[object], DecoderSpec]

    def __init__(self, hf_config, max_model_len: int) -> None:
        super().__init__()
        self.config = hf_config
        spec = type(self).make_spec(hf_config)
        if max_model_len > spec.max_positions:
            # Positions past the table have no embedding: refuse rather than index out of it.
            raise ValueError(
                f"max_model_len={max_model_len} exceeds {self.family}'s {spec.max_positions} learned positions."
            )
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.embed_dim)
        self.embed_positions = nn.Embedding(spec.max_positions + spec.position_offset, spec.hidden_size)
        projected = spec.embed_dim != spec.hidden_size
        self.project_in = nn.Linear(spec.embed_dim, spec.hidden_size, bias=False) if projected else None
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.final_norm = (
            nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, elementwise_affine=spec.norm_affine)
            if spec.final_norm
            else None
        )
        self.project_out = nn.Linear(spec.hidden_size, spec.embed_dim, bias=False) if projected else None
        self.tie_word_embeddings = spec.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.embed_dim, spec.vocab_size, bias=False)
        self.packed_head = None
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids, positions, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta):
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + self.spec.position_offset)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, k_cache, v_cache, meta)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler widens them only when it has to)."""
        if self.packed_head is not None:
            return self.packed_head(hidden)
        return F.linear(hidden, self._head_weight())

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax of the logits per row without writing them, where the packed head can; else None."""
        return self.packed_head.argmax(hidden) if self.packed_head is not None else None

    def activation_dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def init_computed_buffers(self, device: torch.device) -> None:
        """Nothing to compute: the positions are learned, every tensor comes from the checkpoint."""

    def pack_for_cpu(self, kernels: CpuKernels | None = None) -> int:
        """Lays bf16 matmul weights out for the CPU kernels (see cpu_linear); returns the layers packed."""
        from pagedllm.models.cpu_linear import pack_linears, packed_lm_head, place_on_huge_pages

        packed = pack_linears(self.layers, kernels)
        if packed:
            self.packed_head = packed_lm_head(self._head_weight(), kernels)
            packed.append(self.packed_head)
            place_on_huge_pages(packed)
        return len(packed)

    def own_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as (own parameter name, tensor in our layout); the family's
        part. A name it does not know it passes on as it is, for load_hf_weights to refuse."""
        raise NotImplementedError

    def load_hf_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies a Hugging Face checkpoint in. The family names and lays out each tensor
        (own_tensors); parts of the fused q/k/v projection ("...qkv_proj.weight#0" .. "#2") are
        concatenated here in that order. A tied head's saved copy of the embedding is skipped."""
        own = dict(self.named_parameters())
        pending: dict[str, dict[int, torch.Tensor]] = {}
        loaded = set()
        if self.tie_word_embeddings:
            tensors = ((name, t) for name, t in tensors if name != "lm_head.weight")
        for name, t in self.own_tensors(tensors):
            name, _, part = name.partition("#")
            if part:
                parts = pending.setdefault(name, {})
                parts[int(part)] = t
                if len(parts) < 3:
                    continue
                del pending[name]
                t = torch.cat([parts[i] for i in range(3)], dim=0)
            copy_weight(own, name, t)
            loaded.add(name)
        check_all_loaded(own, loaded, pending)
