"""Phi-3 family (Phi-3-mini, Phi-3.5-mini, Phi-4-mini): Llama's decoder with two RoPE differences.

The checkpoints store q/k/v and gate/up fused already ([gate, up], as our MLP splits them), so the
weights load as they are. What differs is RoPE:

- ``partial_rotary_factor`` (Phi-4-mini: 0.75): only the first ``rotary_dim`` dims of each head
  rotate, in pairs (i, i + rotary_dim / 2). The compiled kernels rotate pairs (i, i + head_dim / 2)
  of the whole head. A fixed permutation of each q and k head's dims (the same for both, so q.k and
  attention are unchanged) moves the rotary pairs onto the kernel's pairs and the others onto pairs
  whose tables hold cos 1, sin 0 (rotated by nothing, bit for bit): the q/k rows of the fused qkv
  weight are permuted once at load, and every path (PyTorch, fused loop, whole-step decode plan)
  runs the model as it is. The KV cache holds keys in the permuted order; nothing reads them but
  attention.
- LongRoPE (``rope_type`` "longrope"): short or long rescaling factors. transformers picks them by
  the forward's length, which for a sequence run by ``generate`` means: a token at position p of a
  sequence whose prompt has length L uses the long factors iff max(L, p + 1) >
  original_max_position_embeddings (the prompt as one forward of length L, each generated token
  as a forward of length p + 1). That rule depends on the sequence alone, never on its batch,
  chunking or preemption (L is the original prompt's length: the runner's prompt_lens), so output
  is invariant to them. The tables are one [short rows; long rows] table (as vLLM's cache), and a
  token's row is its position, offset past the short rows when it uses the long factors: the
  kernels index it as they index any table.

Keys are cached rotated, so a prefix computed with the short factors is not the same prefix with
the long ones: ``prefix_cache_salt`` keeps such sequences apart in the prefix cache.
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.checkpoint import rows_of
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.rope import RotaryEmbedding, _rope_inv_freq, _rope_type, rope_cos_sin


def _rope_params(hf_config) -> dict:
    return getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def rotary_dim(hf_config) -> int:
    """How many leading dims of each head RoPE rotates (transformers' int(head_dim * factor))."""
    factor = _rope_params(hf_config).get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return int(_head_dim(hf_config) * (factor if factor is not None else 1.0))


def original_max_positions(hf_config) -> int | None:
    """LongRoPE's original_max_position_embeddings: longer contexts take the long factors. None
    for plain RoPE."""
    if _rope_type(hf_config) != "longrope":
        return None
    orig = _rope_params(hf_config).get("original_max_position_embeddings")
    return int(orig or hf_config.original_max_position_embeddings)


def rotary_permutation(head_dim: int, rot_dim: int) -> torch.Tensor:
    """new_dims = old_dims[perm]: the rotary pairs (i, i + rot_dim / 2) become the kernel's pairs
    (i, i + head_dim / 2); the remaining dims fill the other pairs in order."""
    half, rot_half, pass_half = head_dim // 2, rot_dim // 2, (head_dim - rot_dim) // 2
    first = [*range(rot_half), *range(rot_dim, rot_dim + pass_half)]
    second = [*range(rot_half, rot_dim), *range(rot_dim + pass_half, head_dim)]
    assert len(first) == len(second) == half
    return torch.tensor(first + second, dtype=torch.long, device="cpu")


class Phi3RotaryEmbedding(RotaryEmbedding):
    """Full-head tables in the permuted layout; with LongRoPE, short rows then long rows."""

    def _build_tables(self, hf_config, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        rope_type = _rope_type(hf_config)
        self.original_max = original_max_positions(hf_config)
        if rope_type == "default":
            cos, sin = rope_cos_sin(*_rope_inv_freq(hf_config, rope_type), max_len)
        elif rope_type == "longrope":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            longrope = ROPE_INIT_FUNCTIONS["longrope"]
            # transformers' own two calls: no seq_len gives the short factors, one past the original
            # length the long ones; the attention factor is the same for both
            short_freq, scaling = longrope(hf_config, None)
            long_freq, _ = longrope(hf_config, None, seq_len=self.original_max + 1)
            # a token takes the short factors only at positions below the original length
            self.long_offset = min(self.original_max, max_len)
            short_cos, short_sin = rope_cos_sin(short_freq, scaling, self.long_offset)
            long_cos, long_sin = rope_cos_sin(long_freq, scaling, max_len)
            cos, sin = torch.cat((short_cos, long_cos)), torch.cat((short_sin, long_sin))
        else:
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported for Phi-3")
        head_dim = _head_dim(hf_config)
        rot_dim = cos.shape[1]
        if (head_dim - rot_dim) % 2:
            raise NotImplementedError(f"rotary dims {rot_dim} of head_dim {head_dim}: the passed dims must pair up")
        if rot_dim < head_dim:
            # dims past rot_dim pass through: cos 1, sin 0 rotates them by nothing
            rows = cos.shape[0]
            perm = rotary_permutation(head_dim, rot_dim).to(cos.device)
            cos = torch.cat((cos, torch.ones(rows, head_dim - rot_dim, device=cos.device)), dim=1)[:, perm]
            sin = torch.cat((sin, torch.zeros(rows, head_dim - rot_dim, device=sin.device)), dim=1)[:, perm]
        return cos.contiguous(), sin.contiguous()

    def table_rows(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Each token's row: its position, past the short rows where it takes the long factors."""
        if self.original_max is None:
            return positions
        if meta.prompt_lens is None:
            raise ValueError("LongRoPE needs each token's prompt length (AttentionMetadata.prompt_lens)")
        use_long = torch.maximum(meta.prompt_lens, positions + 1) > self.original_max
        return torch.where(use_long, positions + self.long_offset, positions)


class Phi3ForCausalLM(LlamaForCausalLM):
    rope_class = Phi3RotaryEmbedding
    uses_prompt_lens = True  # LongRoPE picks its rows by them (Phi3RotaryEmbedding.table_rows)

    def prefix_cache_salt(self, num_prompt_tokens: int) -> bytes | None:
        """What besides its tokens decides a sequence's cached keys (the engine's
        Sequence.cache_salt; an optional model method). With LongRoPE, whether the prompt is long:
        then every position takes the long factors, else those below the original length take
        the short ones (see the module's docstring)."""
        orig = self.rope.original_max
        if orig is None:
            return None
        return b"longrope:long" if num_prompt_tokens > orig else b"longrope:short"

    def qkv_row_order(self) -> torch.Tensor | None:
        """new_rows = old_rows[order] for the checkpoint's fused qkv weight (and bias), the whole
        model's: each q and k head's dims in the permuted rotary layout, v as it is; None without
        partial RoPE. Whole rows move, so it applies to GGUF block rows exactly."""
        cfg, d = self.config, self.head_dim
        rot_dim = rotary_dim(cfg)
        if rot_dim == d:
            return None
        perm = rotary_permutation(d, rot_dim)
        q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        n_qk_heads = (q_size + kv_size) // d  # the q heads, then the k heads
        qk = (torch.arange(n_qk_heads).unsqueeze(1) * d + perm).flatten()
        return torch.cat((qk, torch.arange(q_size + kv_size, q_size + 2 * kv_size)))

    def load_weights(self, tensors) -> None:
        """Llama's, each fused qkv tensor's rows put in the rotary layout first (before any rank
        takes its heads)."""
        order = self.qkv_row_order()
        if order is not None:
            tensors = ((n, rows_of(t, order) if ".qkv_proj." in n else t) for n, t in tensors)
        super().load_weights(tensors)
