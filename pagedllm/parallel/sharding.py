"""Cuts a loaded Llama-family model down to one rank's shard, in place, at load time.

Megatron-LM's layout: the fused qkv and gate/up projections are column-parallel (each rank
computes its own heads / intermediate columns, no communication), o_proj and down_proj are
row-parallel (each rank's partial product, one all-reduce), the embedding and the LM head are
vocabulary-parallel. KV heads are split across the ranks; with fewer KV heads than ranks each KV
head is replicated on world_size / num_kv_heads ranks (vLLM's rule), so every rank's query heads
find their group's KV head locally. Each rank's KV cache holds only its KV heads, for the same
block ids: one scheduler and one KV manager (on the driver) serve every rank.

Every rank loads the whole checkpoint and keeps its slices: simple, and at the sizes this runs
(CPU) the transient full copy is the same memory a TP=1 engine holds. GGUF files kept in their
quantized blocks are cut by the same ``LlamaShard`` before their layers are built
(parallel/gguf_sharding.py).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class LlamaShard:
    """The rows and input columns one rank keeps of each Llama-family weight."""

    heads: int  # query heads of this rank
    kv_heads: int  # KV heads of this rank (replicated ones included)
    intermediate: int  # MLP columns of this rank
    q_rows: slice  # of q_proj's rows; also o_proj's input columns (the heads' outputs)
    kv_rows: slice  # of k_proj's rows, and of v_proj's
    inter_rows: slice  # of gate_proj's rows, and of up_proj's; also down_proj's input columns
    vocab_start: int  # first vocabulary row of the embedding / head shard
    vocab_rows: int  # rows of that shard (the last rank's padded past the vocabulary)


def llama_shard(model: LlamaForCausalLM, tp: TensorParallelGroup) -> LlamaShard:
    """``tp.rank``'s shard of ``model`` (its config is all this reads: a meta model will do)."""
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
    i_local = inter // world
    vocab_start, vocab_rows = vocab_shard(model.config.vocab_size, rank, world)
    return LlamaShard(
        heads=heads,
        kv_heads=kv_heads,
        intermediate=i_local,
        q_rows=slice(rank * heads * d, (rank + 1) * heads * d),
        kv_rows=slice(kv_first * d, (kv_first + kv_heads) * d),
        inter_rows=slice(rank * i_local, (rank + 1) * i_local),
        vocab_start=vocab_start,
        vocab_rows=vocab_rows,
    )


def set_shard_sizes(model: LlamaForCausalLM, shard: LlamaShard, tp: TensorParallelGroup) -> None:
    """The head and column counts the attention and MLP code read, set to the shard's."""
    d = model.head_dim
    for layer in model.layers:
        attn = layer.self_attn
        attn.num_heads, attn.num_kv_heads = shard.heads, shard.kv_heads
        attn.q_size, attn.kv_size = shard.heads * d, shard.kv_heads * d
        layer.mlp.inter = shard.intermediate
    model.num_heads, model.num_kv_heads = shard.heads, shard.kv_heads
    model.tensor_parallel_size = tp.world_size


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A plain nn.Linear over the given rows (so the fused CPU path takes it as any layer)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return lin


def _offset(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)


def shard_llama(model: LlamaForCausalLM, tp: TensorParallelGroup) -> None:
    """Replaces ``model``'s layers by ``tp.rank``'s shards (before enable_cpu_kernels, which
    resolves the layers it runs once)."""
    shard = llama_shard(model, tp)
    nh, nkv, d = model.num_heads, model.num_kv_heads, model.head_dim
    inter = model.layers[0].mlp.inter
    # rows of the fused [q; k; v] and [gate; up] weights
    qkv_rows = (shard.q_rows, _offset(shard.kv_rows, nh * d), _offset(shard.kv_rows, (nh + nkv) * d))
    gate_up_rows = (shard.inter_rows, _offset(shard.inter_rows, inter))
    with torch.no_grad():
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
            attn.qkv_proj = dense_linear(
                torch.cat([w[r] for r in qkv_rows]), None if b is None else torch.cat([b[r] for r in qkv_rows])
            )
            local = dense_linear(attn.o_proj.weight[:, shard.q_rows], None)
            attn.o_proj = RowParallelLinear(local, attn.o_proj.bias, tp)
            w, b = mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
            mlp.gate_up_proj = dense_linear(
                torch.cat([w[r] for r in gate_up_rows]), None if b is None else torch.cat([b[r] for r in gate_up_rows])
            )
            local = dense_linear(mlp.down_proj.weight[:, shard.inter_rows], None)
            mlp.down_proj = RowParallelLinear(local, mlp.down_proj.bias, tp)
        start, rows, vocab = shard.vocab_start, shard.vocab_rows, model.config.vocab_size
        emb = shard_rows(model.embed_tokens.weight.detach(), start, rows)
        model.embed_tokens = VocabParallelEmbedding(nn.Embedding.from_pretrained(emb), start, vocab, tp)
        if model.tie_word_embeddings:
            head = emb  # the embedding's shard: one copy
        else:
            head = shard_rows(model.lm_head.weight.detach(), start, rows)
            del model.lm_head  # compute_logits goes through the parallel head only
    # compute_logits / greedy_tokens call a head object where the model holds one (llama.py)
    model.packed_head = VocabParallelHead(head, start, vocab, tp)
    set_shard_sizes(model, shard, tp)
