"""What the attention layers need to know about one flattened batch, built once per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    """One sequence that runs more than one token this step (a prompt chunk).

    Its queries are rows [query_start, query_start + query_len) of the flat batch; it attends to
    positions [0, seq_len) of its own context, read through ``block_ids``.
    """

    query_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] physical blocks, in order
    mask: torch.Tensor | None  # [query_len, seq_len] bool (True = attend); None = plain causal

    @property
    def context_len(self) -> int:
        return self.seq_len - self.query_len


@dataclass
class AttentionMetadata:
    """Layout of a flat batch: the first ``num_decodes`` rows are single-token decodes (one per
    sequence), the rest are prefill chunks."""

    slot_mapping: torch.Tensor  # [num_tokens] long: where each token's K/V is written
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long, padded with 0
    decode_seq_lens: torch.Tensor | None  # [num_decodes] long
    prefills: list[PrefillSeq] = field(default_factory=list)
    # Compiled decode kernel (reads the cache in place), or None for the PyTorch reference path.
    decode_kernel: Callable | None = None
    # Compiled prefill kernel for all prefill chunks at once (pagedllm.kernels.paged_prefill_attention),
    # or None: torch SDPA per sequence.
    prefill_kernel: Callable | None = None
    # [num_tokens] long: the prompt length of each row's sequence (its original prompt, also
    # after a recompute preemption). Not for attention: LongRoPE (models/phi3.py) picks its
    # factors per sequence by it. None where the caller builds no such rows.
    prompt_lens: torch.Tensor | None = None
    _decode_mask: torch.Tensor | None = None
    _prefill_batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def prefill_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill chunks as the prefill kernel takes them (built once per step): block tables
        [n, max_blocks] padded with 0, and the query starts, query lengths, context lengths [n]."""
        if self._prefill_batch is None:
            ps = self.prefills
            width = max(len(p.block_ids) for p in ps)
            tables = torch.zeros(len(ps), width, dtype=torch.long)
            for i, p in enumerate(ps):
                tables[i, : len(p.block_ids)] = p.block_ids
            as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
            self._prefill_batch = (
                tables,
                as_tensor([p.query_start for p in ps]),
                as_tensor([p.query_len for p in ps]),
                as_tensor([p.context_len for p in ps]),
            )
        return self._prefill_batch

    def decode_mask(self, block_size: int) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] bool, True where a key is visible (built once)."""
        if self._decode_mask is None:
            key_pos = torch.arange(self.decode_block_tables.shape[1] * block_size, device=self.slot_mapping.device)
            self._decode_mask = (key_pos.unsqueeze(0) < self.decode_seq_lens.unsqueeze(1)).view(
                self.num_decodes, 1, 1, -1
            )
        return self._decode_mask
