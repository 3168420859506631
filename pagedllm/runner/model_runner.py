"""Executes one scheduled step: builds the flat batch tensors, runs the model, samples.

The runner makes no policy decisions: it runs exactly what the SchedulerOutput says.
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata, PrefillSeq
from pagedllm.kv.base import KVCacheManager
from pagedllm.request import Request
from pagedllm.runner.kv_cache import apply_block_ops
from pagedllm.sampler import Sampler, SamplerOutput
from pagedllm.scheduler import SchedulerOutput


class ModelRunner:
    # Host-memory KV cache for preemption by swapping (set by the engine when swapping is on).
    host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_manager: KVCacheManager,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        cpu_kernels=None,
    ) -> None:
        """``cpu_kernels``: the compiled CPU kernel module (pagedllm.kernels), or None for the reference."""
        self.model = model
        self.kv_caches = kv_caches
        self.kv = kv_manager
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed, cpu_kernels.argmax_rows if cpu_kernels is not None else None)
        self.decode_kernel = cpu_kernels.paged_decode_attention if cpu_kernels is not None else None
        self.prefill_kernel = None
        if cpu_kernels is not None and kv_caches and kv_caches[0][0].dtype == torch.bfloat16:
            if cpu_kernels.prefill_attention_available(model.head_dim, block_size):
                self.prefill_kernel = cpu_kernels.paged_prefill_attention

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        """Runs the step; returns the requests that sampled (in order) and their samples."""
        self.apply_block_ops(sched)
        input_ids, positions, meta, sample_rows, sampling = self._prepare(sched)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not sampling:
            return [], None
        hidden = hidden[sample_rows]
        if self.sampler.argmax_only(sampling):
            ids = self.model.greedy_tokens(hidden)
            if ids is not None:
                return sampling, SamplerOutput.of_tokens(ids.tolist())
        logits = self.model.compute_logits(hidden)
        # Sampling runs on the host: per-request torch.Generators are CPU generators.
        return sampling, self.sampler(logits.cpu(), sampling)

    @torch.inference_mode()
    def apply_block_ops(self, sched: SchedulerOutput) -> None:
        """Copy-on-write copies and swaps the scheduler recorded, before the forward writes anything."""
        if sched.block_ops:
            apply_block_ops(sched.block_ops, self.kv_caches, self.host_kv_caches)

    def _prepare(self, sched: SchedulerOutput):
        bs = self.block_size
        dev = self.device
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []

        # Decodes: one row each, attending through a padded block-table matrix.
        nd = len(decodes)
        decode_bt = decode_lens = None
        if nd:
            tables = []
            lens = []
            for s in decodes:
                r = s.request
                pos = r.num_computed_tokens
                table = self.kv.block_table(r.request_id)
                tokens.append(r.all_token_ids[pos])
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
                lens.append(pos + 1)
                tables.append(table[: pos // bs + 1])
            max_blocks = max(len(t) for t in tables)
            decode_bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long, device=dev)
            decode_lens = torch.tensor(lens, dtype=torch.long, device=dev)
            for i, s in enumerate(decodes):
                if s.samples:
                    sample_rows.append(i)
                    sampling.append(s.request)

        # Prefill chunks: a contiguous run of rows each.
        prefill_seqs = []
        for s in prefills:
            r = s.request
            start, n = r.num_computed_tokens, s.num_new_tokens
            end = start + n
            table = self.kv.block_table(r.request_id)
            q_start = len(tokens)
            tokens.extend(r.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            num_blocks = -(-end // bs)
            mask = None
            if start > 0 and self.prefill_kernel is None:  # the kernel masks by positions itself
                # Query i (position start + i) sees keys 0..start + i.
                q_pos = torch.arange(start, end, device=dev).unsqueeze(1)
                mask = torch.arange(end, device=dev).unsqueeze(0) <= q_pos
            prefill_seqs.append(
                PrefillSeq(
                    query_start=q_start,
                    query_len=n,
                    seq_len=end,
                    block_ids=torch.tensor(table[:num_blocks], dtype=torch.long, device=dev),
                    mask=mask,
                )
            )
            if s.samples:
                sample_rows.append(q_start + n - 1)
                sampling.append(r)

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=nd,
            decode_block_tables=decode_bt,
            decode_seq_lens=decode_lens,
            prefills=prefill_seqs,
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return input_ids, pos_t, meta, rows, sampling
