"""Cuts a loaded Llama-family model down to one rank's shard, in place, at load time.

Megatron-LM's layout: the fused qkv and gate/up projections are column-parallel (each rank
computes its own heads / intermediate columns, no communication), o_proj and down_proj are
row-parallel (each rank's partial product, one all-reduce), the embedding and the LM head are
vocabulary-parallel. KV heads are split across the ranks; with fewer KV heads than ranks each KV
head is replicated on world_size / num_kv_heads ranks (vLLM's rule), so every rank's query heads
find their group's KV head locally. Each rank's KV cache holds only its KV heads, for the same
block ids: one scheduler and one KV manager (on the driver) serve every rank.

Every rank loads the whole checkpoint and keeps its slices: simple, and at the sizes this runs
(CPU) the transient full copy is the same memory a TP=1 engine holds.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from pagedllm.parallel.group import TensorParallelGroup
from pagedllm.parallel.layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    shard_rows,
    vocab_shard,
)


def tensor_parallel_refusal(num_heads: int, num_kv_heads: int, intermediate_size: int, world_size: int) -> str | None:
    """Why this model cannot be split over ``world_size`` ranks, or None."""
    if num_heads % world_size:
        return f"{num_heads} attention heads do not split over {world_size} ranks"
    if num_kv_heads % world_size and world_size % num_kv_heads:
        return f"{num_kv_heads} KV heads neither split over nor replicate onto {world_size} ranks"
    if intermediate_size % world_size:
        return f"intermediate size {intermediate_size} does not split over {world_size} ranks"
    return None


def _column_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A plain nn.Linear over the given output rows (so the fused CPU path takes it as any layer)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return lin


def shard_llama(model: LlamaForCausalLM, tp: TensorParallelGroup) -> None:
    """Replaces ``model``'s layers by ``tp.rank``'s shards (before enable_cpu_kernels, which
    resolves the layers it runs once)."""
    # Exactly these classes: subclasses with layers or RoPE of their own (Gemma 3, Phi-3) are not
    # sharded by these rules, and their output under tensor parallelism is not tested.
    if type(model) not in (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM):
        raise ValueError(f"tensor parallelism supports Llama, Mistral, Qwen2 and Qwen3, not {type(model).__name__}")
    world, rank = tp.world_size, tp.rank
    nh, nkv, d = model.num_heads, model.num_kv_heads, model.head_dim
    inter = model.layers[0].mlp.inter
    refusal = tensor_parallel_refusal(nh, nkv, inter, world)
    if refusal is not None:
        raise ValueError(f"tensor_parallel_size={world}: {refusal}")
    heads = nh // world
    kv_heads = nkv // world if nkv >= world else 1
    kv_first = rank * kv_heads if nkv >= world else rank // (world // nkv)
    q_rows = slice(rank * heads * d, (rank + 1) * heads * d)
    k_rows = slice(nh * d + kv_first * d, nh * d + (kv_first + kv_heads) * d)
    v_rows = slice(k_rows.start + nkv * d, k_rows.stop + nkv * d)
    i_local = inter // world
    gate_rows = slice(rank * i_local, (rank + 1) * i_local)
    up_rows = slice(inter + gate_rows.start, inter + gate_rows.stop)
    with torch.no_grad():
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
            rows = (q_rows, k_rows, v_rows)
            attn.qkv_proj = _column_linear(
                torch.cat([w[r] for r in rows]), None if b is None else torch.cat([b[r] for r in rows])
            )
            attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, q_rows], attn.o_proj.bias, tp)
            attn.num_heads, attn.num_kv_heads = heads, kv_heads
            attn.q_size, attn.kv_size = heads * d, kv_heads * d
            w, b = mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
            mlp.gate_up_proj = _column_linear(
                torch.cat([w[gate_rows], w[up_rows]]),
                None if b is None else torch.cat([b[gate_rows], b[up_rows]]),
            )
            mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, gate_rows], mlp.down_proj.bias, tp)
            mlp.inter = i_local
        vocab = model.config.vocab_size
        start, rows_per_rank = vocab_shard(vocab, rank, world)
        emb = shard_rows(model.embed_tokens.weight.detach(), start, rows_per_rank)
        model.embed_tokens = VocabParallelEmbedding(emb, start, vocab, tp)
        if model.tie_word_embeddings:
            head = model.embed_tokens.weight
        else:
            head = shard_rows(model.lm_head.weight.detach(), start, rows_per_rank)
            del model.lm_head  # compute_logits goes through the parallel head only
    # compute_logits / greedy_tokens call a head object where the model holds one (llama.py)
    model.packed_head = VocabParallelHead(head, start, vocab, tp)
    model.num_heads, model.num_kv_heads = heads, kv_heads
    model.tensor_parallel_size = world
