"""Executes one scheduled step: updates its own sequence states and block tables from the
SchedulerOutput, builds the flat batch tensors, runs the model, samples.

The runner makes no policy decisions and never sees a KV manager: it runs exactly what the
SchedulerOutput says, from the state that output (and the ones before it) gave it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import torch

from pagedllm.attention.metadata import AttentionMetadata, PrefillSeq
from pagedllm.kernels.interface import CpuKernels
from pagedllm.logprobs import Logprob, logprob_dicts
from pagedllm.runner.block_table import BlockTables
from pagedllm.runner.kv_cache import apply_block_ops
from pagedllm.runner.seq_state import SeqState
from pagedllm.sampler import AllowedTokens, Sampler, SamplerOutput
from pagedllm.scheduler_output import ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput
from pagedllm.spec_decode.rejection import rejection_sample
from pagedllm.spec_decode.verify import keep_accepted
from pagedllm.utils import cdiv

if TYPE_CHECKING:
    from pagedllm.spec_decode.draft_model import DraftProposer

logger = logging.getLogger("pagedllm")

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
# Prompt logprobs take the logits of at most this many rows at a time (a 2048-token prefill's
# [rows, vocab] float32 logits at once would be 400 MB for a 49k vocabulary).
PROMPT_LOGPROBS_ROWS = 256


class _PromptRun(NamedTuple):
    """Rows of this step's batch whose logits give a sequence's prompt logprobs."""

    state: SeqState
    row: int  # first row in the flat batch
    position: int  # its position in the sequence
    count: int


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: KVCaches,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        seed: int = 0,
        kernels: CpuKernels | None = None,
        host_kv_caches: KVCaches | None = None,
    ) -> None:
        """``kernels``: the compiled CPU kernels, or None for the PyTorch reference path.
        ``host_kv_caches``: the host-memory KV pool's tensors when preemption may swap."""
        self.model = model
        # Each row's prompt length goes into the metadata only for a model that reads it (LongRoPE):
        # for the others it would be per-step work on the hot path for nothing.
        self.send_prompt_lens = bool(getattr(model, "uses_prompt_lens", False))
        self.kv_caches = kv_caches
        self.host_kv_caches = host_kv_caches
        self.block_size = block_size
        self.device = device
        self.states: dict[str, SeqState] = {}
        self.block_tables = BlockTables(cdiv(max_model_len, block_size))
        self.sampler = Sampler(
            seed,
            kernels.argmax_rows if kernels is not None else None,
            kernels.apply_token_bitmask if kernels is not None else None,
        )
        self.decode_kernel = None
        self.prefill_kernel = None
        self.prefill_as_decode_rows = False
        if kernels is not None and kv_caches:
            self._choose_attention_kernels(kernels, kv_caches[0][0], block_size)
        # The draft model's proposer (spec_decode/draft_model.py) when the engine speculates with one.
        self.drafter: DraftProposer | None = None

    def _choose_attention_kernels(self, kernels: CpuKernels, k_cache: torch.Tensor, block_size: int) -> None:
        """The compiled attention kernels this model's caches can use, decided once here: a kernel
        that refuses the shape would otherwise fail every step (the reference path takes any)."""
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
        # the queries' dtype: the caches' may be narrower (kv_cache_dtype)
        act = self.model.activation_dtype() if hasattr(self.model, "activation_dtype") else k_cache.dtype
        refusal = kernels.decode_attention_refusal(act, self.model.num_heads, num_kv_heads, head_dim, k_cache.dtype)
        if refusal is not None:
            logger.warning("pagedllm: the decode attention kernel does not take %s; it runs the PyTorch path", refusal)
        else:
            self.decode_kernel = kernels.paged_decode_attention
        # Available only where built with AVX512-BF16, for some head sizes: not a refusal worth a log line.
        if act == k_cache.dtype == torch.bfloat16 and kernels.prefill_attention_available(head_dim, block_size):
            self.prefill_kernel = kernels.paged_prefill_attention
        # float32 has no prefill kernel: its prefill queries run through the decode kernel, a row
        # each, so a row's result never depends on the chunk (torch's SDPA sums a row differently
        # for other query counts on AVX512 CPUs). bf16 keeps SDPA where its prefill kernel does not
        # run: the bf16 decode kernel rounds probabilities to bf16, further from transformers' bf16.
        self.prefill_as_decode_rows = self.decode_kernel is not None and act == torch.float32

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Runs the step; returns the samples of the sequences that reached their last token."""
        # Block moves first: the KV manager already counts them as done, so nothing that can
        # raise (a bad state update) may come between the schedule and them.
        self.apply_block_ops(sched)
        self.update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput.empty()
        spec = sched.spec_token_ids
        if sched.num_model_drafts:
            assert self.drafter is not None, "draft-model drafts scheduled without a draft model"
            spec = {**spec, **self.drafter.propose(self.states, sched.num_model_drafts)}
        input_ids, positions, meta, sample_rows, sampling, prompt_runs = self._prepare(sched, spec)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        prompt_lps = self._prompt_logprobs(hidden, prompt_runs) if prompt_runs else {}
        if not sampling:
            return ModelRunnerOutput([], [], [], [], prompt_lps)
        hidden = hidden[sample_rows]
        drawn_rows = [i for i, s in enumerate(sampling) if s.seq_id in spec and not s.sampling_params.greedy]
        drawn = None
        if drawn_rows:  # speculating sequences that sample: rejection sampling, apart
            drawn = self._rejection_sample(hidden[drawn_rows], [sampling[i] for i in drawn_rows], spec, sched)
            rest = sorted(set(range(len(sampling))) - set(drawn_rows))
            hidden, sampling = hidden[rest], [sampling[i] for i in rest]
            if not sampling:
                drawn.prompt_logprobs = prompt_lps
                return drawn
        seq_ids = [s.seq_id for s in sampling]
        allowed = _allowed_tokens(sched, seq_ids)
        out = None
        if allowed is None and self.sampler.argmax_only(sampling):
            ids = self.model.greedy_tokens(hidden)
            if ids is not None:
                out = SamplerOutput.of_tokens(ids.tolist())
        if out is None:
            logits = self.model.compute_logits(hidden)
            # Sampling runs on the host: per-sequence torch.Generators are CPU generators.
            out = self.sampler(logits.cpu(), sampling, allowed)
        result = ModelRunnerOutput(seq_ids, out.token_ids, out.chosen_logprobs, out.top_logprobs, prompt_lps)
        if spec:
            result = keep_accepted(result, spec)
        if drawn is not None:
            result.extend(drawn)
        return result

    def _rejection_sample(
        self, hidden: torch.Tensor, rows: list[SeqState], spec: dict[str, list[int]], sched: SchedulerOutput
    ) -> ModelRunnerOutput:
        """The kept tokens of speculating sequences that sample (``rows``: each one's positions,
        consecutive), drawn from their own generators (spec_decode/rejection.py)."""
        seq_ids: list[str] = []
        tokens: list[int] = []
        i = 0
        while i < len(rows):
            state = rows[i]
            drafts = spec[state.seq_id]
            n = len(drafts) + 1
            logits = self.model.compute_logits(hidden[i : i + n]).cpu().float()
            allowed = _allowed_tokens(sched, [state.seq_id] * n)
            if allowed is not None:  # each position's grammar mask: the target samples the masked p
                allowed.apply(logits, self.sampler.apply_token_bitmask)
            probs = self.sampler.target_probs(logits, [state] * n)
            kept = rejection_sample(probs, drafts, state.generator or self.sampler.generator)
            seq_ids.extend([state.seq_id] * len(kept))
            tokens.extend(kept)
            i += n
        none = [None] * len(tokens)
        return ModelRunnerOutput(seq_ids, tokens, list(none), list(none))

    def _prompt_logprobs(self, hidden: torch.Tensor, runs: list[_PromptRun]) -> dict[str, PromptLogprobsChunk]:
        """log p(prompt token p + 1 | tokens 0..p) for each run's positions p, from the same hidden
        states the step samples from: float32 log-softmax of the model's logits, as the sampler's
        logprobs. The row at position p predicts prompt token p + 1, so a run of positions
        [start, start + n) gives the entries of prompt tokens start + 1 .. start + n."""
        out = {}
        for run in runs:
            k = run.state.sampling_params.prompt_logprobs or 0
            p0 = run.position + 1  # the prompt token its first row predicts
            entries: list[dict[int, Logprob]] = []
            for a in range(0, run.count, PROMPT_LOGPROBS_ROWS):
                b = min(a + PROMPT_LOGPROBS_ROWS, run.count)
                logits = self.model.compute_logits(hidden[run.row + a : run.row + b]).float().cpu()
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)
                targets = run.state.all_token_ids[p0 + a : p0 + b]
                entries.extend(logprob_dicts(logits, lse, targets, [k] * len(targets)))
            out[run.state.seq_id] = PromptLogprobsChunk(p0, entries)
        return out

    def update_states(self, sched: SchedulerOutput) -> None:
        """Brings the runner's sequences and block tables up to date with the scheduler's view."""
        # A sequence whose blocks are gone or moved has no draft K/V to trust.
        forget = self.drafter.forget if self.drafter is not None else lambda seq_id: None
        for seq_id in sched.finished_seq_ids:
            self.states.pop(seq_id, None)
            self.block_tables.remove(seq_id)
            forget(seq_id)
        for seq_id in sched.preempted_seq_ids:
            self.block_tables.remove(seq_id)  # its generator stays: it draws on when it is back
            forget(seq_id)
        for new in sched.new_seqs:
            forget(new.seq_id)
            state = self.states.get(new.seq_id)
            if state is None:
                prompt = new.token_ids[: new.num_prompt_tokens]
                state = self.states[new.seq_id] = SeqState(new.seq_id, prompt, new.sampling_params, new.seed)
            state.reset_tokens(new.token_ids, new.num_prompt_tokens)
            state.num_computed_tokens = new.num_computed_tokens
            state.wants_prompt_logprobs = new.wants_prompt_logprobs
            self.block_tables.set(new.seq_id, new.block_ids)
        for c in sched.cached_seqs:
            state = self.states[c.seq_id]
            state.all_token_ids.extend(c.new_token_ids)
            state.num_computed_tokens = c.num_computed_tokens
            if c.truncate_to is not None:
                self.block_tables.truncate(c.seq_id, c.truncate_to)
            self.block_tables.update(c.seq_id, c.new_block_ids, c.replaced_blocks)

    @torch.inference_mode()
    def apply_block_ops(self, sched: SchedulerOutput) -> None:
        """Copy-on-write copies and swaps the scheduler recorded, before the forward writes anything."""
        if sched.block_ops:
            apply_block_ops(sched.block_ops, self.kv_caches, self.host_kv_caches)
            if self.drafter is not None:
                self.drafter.apply_copies(sched.block_ops)

    @torch.inference_mode()
    def greedy_tokens(self, sched: SchedulerOutput) -> dict[str, int]:
        """Runs ``sched``'s tokens (no block ops, no state updates, no drafts) and returns the argmax
        next token of each sequence that reached its last known token: a draft model's proposals."""
        input_ids, positions, meta, sample_rows, sampling, _ = self._prepare(sched, {})
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not sampling:  # chunks short of their sequences' last tokens: K/V written, nothing to draft
            return {}
        hidden = hidden[sample_rows]
        ids = self.model.greedy_tokens(hidden)
        if ids is None:
            ids = self.model.compute_logits(hidden).argmax(dim=-1)
        return {s.seq_id: int(t) for s, t in zip(sampling, ids.tolist(), strict=True)}

    def _prepare(self, sched: SchedulerOutput, spec: dict[str, list[int]]):
        bs = self.block_size
        dev = self.device
        tables = self.block_tables
        scheduled = [(self.states[sid], n) for sid, n in sched.num_scheduled_tokens.items()]
        decodes = [s for s, n in scheduled if n == 1]
        prefills = [(s, n) for s, n in scheduled if n > 1]
        tokens: list[int] = []
        sample_rows: list[int] = []
        sampling: list[SeqState] = []
        prompt_runs: list[_PromptRun] = []

        def prompt_run(s: SeqState, row: int, start: int, n: int) -> None:
            # Positions start .. start + n - 1 run at rows row ..; those before the prompt's last
            # predict a prompt token (the last one's logits give the first sampled token).
            count = min(start + n, s.num_prompt_tokens - 1) - start
            if s.wants_prompt_logprobs and count > 0:
                prompt_runs.append(_PromptRun(s, row, start, count))

        # Decodes: one row each, attending through a padded block-table matrix.
        nd = len(decodes)
        decode_bt = decode_lens = None
        slot_parts = []
        pos_parts = []
        prompt_len_parts = []
        if nd:
            pos = [s.num_computed_tokens for s in decodes]
            tokens.extend(s.all_token_ids[p] for s, p in zip(decodes, pos, strict=True))
            rows = torch.tensor([tables.row(s.seq_id) for s in decodes], dtype=torch.long)
            width = max(p // bs for p in pos) + 1
            decode_bt = tables.table[rows, :width]
            pos_t = torch.tensor(pos, dtype=torch.long)
            slot_parts.append(decode_bt.gather(1, (pos_t // bs).unsqueeze(1)).squeeze(1) * bs + pos_t % bs)
            pos_parts.append(pos_t)
            if self.send_prompt_lens:
                prompt_len_parts.append(torch.tensor([s.num_prompt_tokens for s in decodes], dtype=torch.long))
            decode_lens = (pos_t + 1).to(dev)
            decode_bt = decode_bt.to(dev)
            for i, s in enumerate(decodes):
                prompt_run(s, i, s.num_computed_tokens, 1)
                if s.num_computed_tokens + 1 == s.num_tokens:
                    sample_rows.append(i)
                    sampling.append(s)

        # Prefill chunks: a contiguous run of rows each.
        prefill_seqs = []
        for s, n in prefills:
            start = s.num_computed_tokens
            end = start + n
            row = tables.table[tables.row(s.seq_id)]
            q_start = len(tokens)
            drafts = spec.get(s.seq_id)
            # A speculating sequence runs its last token and its drafts, like a prefill chunk.
            seq_tokens = s.all_token_ids if drafts is None else s.all_token_ids + drafts
            tokens.extend(seq_tokens[start:end])
            prompt_run(s, q_start, start, n)
            p = torch.arange(start, end, dtype=torch.long)
            pos_parts.append(p)
            if self.send_prompt_lens:
                prompt_len_parts.append(torch.full((n,), s.num_prompt_tokens, dtype=torch.long))
            slot_parts.append(row[p // bs] * bs + p % bs)
            mask = None
            # the kernels mask by positions themselves
            if start > 0 and self.prefill_kernel is None and not self.prefill_as_decode_rows:
                # Query i (position start + i) sees keys 0..start + i.
                q_pos = torch.arange(start, end, device=dev).unsqueeze(1)
                mask = torch.arange(end, device=dev).unsqueeze(0) <= q_pos
            prefill_seqs.append(
                PrefillSeq(
                    query_start=q_start,
                    query_len=n,
                    seq_len=end,
                    block_ids=row[: cdiv(end, bs)].to(dev),
                    mask=mask,
                )
            )
            if drafts is not None:  # every position gives a target token
                sample_rows.extend(range(q_start, q_start + n))
                sampling.extend([s] * n)
            elif end == s.num_tokens:
                sample_rows.append(q_start + n - 1)
                sampling.append(s)

        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts).to(dev),
            num_decodes=nd,
            decode_block_tables=decode_bt,
            decode_seq_lens=decode_lens,
            prefills=prefill_seqs,
            decode_kernel=self.decode_kernel,
            prefill_kernel=self.prefill_kernel,
            prefill_as_decode_rows=self.prefill_as_decode_rows,
            prompt_lens=torch.cat(prompt_len_parts).to(dev) if self.send_prompt_lens else None,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        positions = torch.cat(pos_parts).to(dev)
        rows_t = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return input_ids, positions, meta, rows_t, sampling, prompt_runs


def _allowed_tokens(sched: SchedulerOutput, seq_ids: list[str]) -> AllowedTokens | None:
    """The structured-output masks of this step's sampling rows, or None when no row has one. A
    speculating sequence's rows (one per position, consecutive) take its mask rows in order."""
    bitmask = sched.grammar_bitmask
    if bitmask is None:
        return None
    rows = []
    seen: dict[str, int] = {}  # rows of each sequence so far: the position within its run
    for i, sid in enumerate(seq_ids):
        first = bitmask.rows.get(sid)
        if first is not None:
            k = seen.get(sid, 0)
            seen[sid] = k + 1
            rows.append((i, first + k))
    if not rows:
        return None
    return AllowedTokens([i for i, _ in rows], bitmask.mask[[r for _, r in rows]])
