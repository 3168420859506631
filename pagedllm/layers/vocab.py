"""The token embedding and the LM head, each holding one rank's rows of the vocabulary.

Equal shards, the last padded past the vocabulary with zero rows so every rank's all-gather part
has the same shape. The embedding looks up its own rows and zeros for other ranks' ids, and the
all-reduce fills each row from the rank that holds it (exact: one term is non-zero). The head
all-gathers the logits, or for greedy steps only each rank's best (value, id). A tied head reads
the embedding's rows: one copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.checkpoint import CheckpointTensor, padded_rows
from pagedllm.layers.linear_method import LinearMethods
from pagedllm.parallel.group import TensorParallelGroup


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, start + rows) of the (padded) vocabulary held by ``rank``."""
    rows = -(-vocab_size // world_size)
    return rank * rows, rows


class _VocabRows(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.vocab_size, self.dim, self.tp = vocab_size, dim, tp
        world, rank = (1, 0) if tp is None else (tp.world_size, tp.rank)
        self.vocab_start, self.rows = vocab_shard(vocab_size, rank, world)
        self.vocab_end = min(self.vocab_start + self.rows, vocab_size)
        self._rows: CheckpointTensor | None = None

    def weight_loader(self, kind: str, t: CheckpointTensor, part: int | None = None) -> int:
        if kind != "weight" or tuple(t.shape) != (self.vocab_size, self.dim):
            raise ValueError(f"checkpoint {kind} of shape {tuple(t.shape)} != model {(self.vocab_size, self.dim)}")
        self._rows = padded_rows(t, self.vocab_start, self.rows)
        return t.numel()

    def missing(self) -> list[str]:
        return ["weight"] if self._rows is None else []

    def _take_rows(self) -> CheckpointTensor:
        if self._rows is None:
            raise ValueError("checkpoint is missing weight")
        rows, self._rows = self._rows, None
        return rows


class VocabParallelEmbedding(_VocabRows):
    """``local``: an nn.Embedding, or a QuantizedEmbedding of GGUF blocks. ``tied_head``: a head
    reads these rows, and builds both (ParallelLMHead.finish)."""

    tied_head = False

    def finish(self, methods: LinearMethods) -> None:
        self.local = methods.embedding(self._take_rows())
        self.dtype = methods.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.local(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        x = self.local(local).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(_VocabRows):
    """``__call__``: the whole logits on every rank; ``argmax``: greedy tokens without gathering
    the [rows, vocab] logits. Ties go to the lowest vocabulary index, as torch.argmax.
    ``tied_to``: the embedding whose rows this head reads (the checkpoint has no head of its own)."""

    def __init__(
        self, vocab_size: int, dim: int, tp: TensorParallelGroup | None, tied_to: VocabParallelEmbedding | None = None
    ) -> None:
        super().__init__(vocab_size, dim, tp)
        self.tied_to = [tied_to] if tied_to is not None else []  # a list: not a submodule
        if tied_to is not None:
            tied_to.tied_head = True
        # a float weight (F.linear), or a layer over the rows (PackedLinear, QuantizedLinear)
        self.local: torch.Tensor | nn.Module | None = None

    def missing(self) -> list[str]:
        return self.tied_to[0].missing() if self.tied_to else super().missing()

    def finish(self, methods: LinearMethods) -> None:
        """Builds the head (and a tied embedding with it, from the same rows)."""
        if self.tied_to:
            emb = self.tied_to[0]
            self.local, emb.local = methods.tied_head_and_embedding(emb._take_rows())
            emb.dtype = methods.dtype
        else:
            self.local = methods.head(self._take_rows())
        self.num_valid = max(0, min(self.rows, self.vocab_size - self.vocab_start))  # padding rows excluded

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.local, torch.Tensor):
            return F.linear(hidden, self.local)
        return self.local(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._local_logits(hidden)
        parts = self.tp.all_gather(self._local_logits(hidden))
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """None where one rank's head has no fused argmax (the caller computes the logits)."""
        if self.tp is None:
            if isinstance(self.local, torch.Tensor):
                return None
            return self.local.argmax(hidden)
        logits = self._local_logits(hidden)[..., : self.num_valid]
        best, idx = logits.max(dim=-1)  # first occurrence of the maximum, as torch.argmax
        # One all-gather of (value, vocabulary id) pairs: float64 holds both exactly.
        pairs = torch.stack([best.double(), (idx + self.vocab_start).double()])
        gathered = torch.stack(self.tp.all_gather(pairs))  # [ranks, 2, rows]
        winner = gathered[:, 0].argmax(dim=0)  # the lowest rank among equal maxima: the lowest id
        return gathered[:, 1].gather(0, winner.unsqueeze(0)).squeeze(0).long()
