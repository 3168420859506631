"""What the attention layers need to know about one flattened batch, built once per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedllm.kv.base import NULL_BLOCK


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
    # No prefill kernel for this cache (float32): each prefill query runs through decode_kernel as
    # a row of its own (decided by the runner, see ModelRunner._choose_attention_kernels).
    prefill_as_decode_rows: bool = False
    # [num_tokens] long: the prompt length of each row's sequence (its original prompt, also
    # after a recompute preemption). Not for attention: LongRoPE (models/phi3.py) picks its
    # factors per sequence by it. None where the caller builds no such rows.
    prompt_lens: torch.Tensor | None = None
    _decode_views: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _prefill_batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _prefill_rows: tuple[torch.Tensor, torch.Tensor] | None = None

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

    def prefill_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every prefill query as a decode row (built once per step): its sequence's block table
        [rows, max_blocks] and its own key count (position + 1) [rows]. The prefill rows are the
        contiguous rows from the first chunk's query_start on."""
        if self._prefill_rows is None:
            tables, _, q_lens, ctx_lens = self.prefill_batch()
            lens = torch.cat(
                [torch.arange(c + 1, c + n + 1) for c, n in zip(ctx_lens.tolist(), q_lens.tolist(), strict=True)]
            )
            self._prefill_rows = (tables.repeat_interleave(q_lens, dim=0), lens)
        return self._prefill_rows

    def rows_as_decodes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row of the step as a decode row, in row order (prefill_as_decode_rows steps):
        block tables [rows, max_blocks] padded with 0, and each row's key count [rows]."""
        if not self.prefills:
            return self.decode_block_tables, self.decode_seq_lens
        tables, lens = self.prefill_rows()
        if not self.num_decodes:
            return tables, lens
        dt = self.decode_block_tables
        width = max(dt.shape[1], tables.shape[1])
        padded = torch.zeros(dt.shape[0] + tables.shape[0], width, dtype=torch.long)
        padded[: dt.shape[0], : dt.shape[1]] = dt
        padded[dt.shape[0] :, : tables.shape[1]] = tables
        return padded, torch.cat([self.decode_seq_lens, lens])

    def decode_view(self, block_size: int, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' block tables and visibility mask [num_decodes, 1, 1, keys] as the
        reference path reads them (built once per window per step). With a window, the tables
        start at the first block any row's window reaches (no row needs the ones before), and
        released entries (NULL_BLOCK) left inside point at the row's first block still in its
        window instead: read (a gather needs a real block), masked out."""
        view = self._decode_views.get(window)
        if view is None:
            bt, lens = self.decode_block_tables, self.decode_seq_lens
            first_block = 0 if window is None else int((lens - window).clamp(min=0).min()) // block_size
            bt = bt[:, first_block:]
            key_pos = first_block * block_size + torch.arange(bt.shape[1] * block_size, device=bt.device)
            mask = key_pos.unsqueeze(0) < lens.unsqueeze(1)
            if window is not None:
                starts = (lens - window).clamp(min=0)
                mask &= key_pos.unsqueeze(0) >= starts.unsqueeze(1)
                own_first = bt.gather(1, (starts // block_size - first_block).unsqueeze(1))
                bt = torch.where(bt == NULL_BLOCK, own_first, bt)
            view = self._decode_views[window] = (bt, mask.view(self.num_decodes, 1, 1, -1))
        return view
