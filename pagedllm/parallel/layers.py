"""Layers whose weights are one rank's shard, each ending in the collective that makes its output
whole (Megatron-LM's column / row / vocab parallelism).

Column-parallel projections (fused qkv, gate/up) need no layer of their own: a plain nn.Linear
(or a QuantizedLinear of GGUF blocks) holding the rank's rows of the weight, whose outputs the
next row-parallel layer consumes locally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.parallel.group import TensorParallelGroup


class RowParallelLinear(nn.Module):
    """y = x_r W_r^T summed over the ranks (one all-reduce), + bias once after the sum.

    x_r: this rank's slice of the input features (the heads / intermediate columns it computed);
    ``local``: the layer of W_r, bias-free (an nn.Linear, or a QuantizedLinear over whole
    quantization blocks of the columns).
    """

    def __init__(self, local: nn.Module, bias: torch.Tensor | None, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.local = local
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.local(x))
        return out if self.bias is None else out + self.bias


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, start + rows) of the (padded) vocabulary held by ``rank``: equal shards, the last
    padded past vocab_size so every rank's all-gather part has the same shape."""
    rows = -(-vocab_size // world_size)
    return rank * rows, rows


def shard_rows(weight: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """weight[start : start + rows], zero rows past its end."""
    part = weight[start : start + rows]
    if part.shape[0] == rows:
        return part.clone()
    pad = weight.new_zeros((rows - part.shape[0], *weight.shape[1:]))
    return torch.cat([part, pad])


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding (``local``: an nn.Embedding, or a QuantizedEmbedding of
    GGUF blocks); ids of other ranks' rows look up zeros, and the all-reduce fills each row from
    the rank that holds it (exact: one term is non-zero)."""

    def __init__(self, local: nn.Module, vocab_start: int, vocab_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.local = local
        rows = local.num_embeddings if isinstance(local, nn.Embedding) else local.qweight.shape[0]
        self.vocab_start = vocab_start
        self.vocab_end = min(vocab_start + rows, vocab_size)
        self.tp = tp

    @property
    def dtype(self) -> torch.dtype:
        """Of the output (the model's activation dtype, LlamaForCausalLM.activation_dtype)."""
        return self.local.weight.dtype if isinstance(self.local, nn.Embedding) else self.local.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        x = self.local(local).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary rows. ``__call__``: the whole logits on every rank
    (an all-gather); ``argmax``: greedy tokens from each rank's best (value, index) only, the
    [rows, vocab] logits never gathered. Ties go to the lowest vocabulary index, as torch.argmax."""

    def __init__(
        self, local: torch.Tensor | nn.Module, vocab_start: int, vocab_size: int, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        # a float weight (may be the embedding's shard, tied: shared, not copied), or a layer over
        # the rows (QuantizedLinear of GGUF blocks)
        self.local = local
        rows = local.shape[0] if isinstance(local, torch.Tensor) else local.out_features
        self.vocab_start, self.vocab_size = vocab_start, vocab_size
        self.num_valid = max(0, min(rows, vocab_size - vocab_start))  # padding rows excluded
        self.tp = tp

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.local, torch.Tensor):
            return F.linear(hidden, self.local)
        return self.local(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = self.tp.all_gather(self._local_logits(hidden))
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._local_logits(hidden)[..., : self.num_valid]
        best, idx = logits.max(dim=-1)  # first occurrence of the maximum, as torch.argmax
        # One all-gather of (value, vocabulary id) pairs: float64 holds both exactly.
        pairs = torch.stack([best.double(), (idx + self.vocab_start).double()])
        gathered = torch.stack(self.tp.all_gather(pairs))  # [ranks, 2, rows]
        winner = gathered[:, 0].argmax(dim=0)  # the lowest rank among equal maxima: the lowest id
        return gathered[:, 1].gather(0, winner.unsqueeze(0)).squeeze(0).long()
