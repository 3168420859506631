"""The runner's block tables and sequence states come from SchedulerOutputs alone, and always
equal what the KV manager holds: driven through admissions, chunked prefill, forks with
copy-on-write, preemption by recompute and by swapping, aborts."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.kv.paged import PagedKVCacheManager
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import Scheduler
from pagedllm.scheduler_output import ModelRunnerOutput
from pagedllm.sequence import Sequence, SequenceStatus


def runner_without_model(block_size: int, max_model_len: int) -> ModelRunner:
    return ModelRunner(torch.nn.Identity(), [], block_size, max_model_len, torch.device("cpu"))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_runner_tables_equal_the_kv_managers(seed, mode):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    config = EngineConfig(block_size=bs, max_num_batched_tokens=rng.choice([8, 32, 256]), preemption_mode=mode)
    kv = PagedKVCacheManager(rng.randrange(12, 40), bs, enable_prefix_caching=rng.random() < 0.5)
    if mode == "swap":
        kv.enable_swap(64)
    sched = Scheduler(config, kv, max_model_len=96)
    runner = runner_without_model(bs, 96)
    next_id = 0
    for _ in range(150):
        if rng.random() < 0.3 and len(sched.seqs) < 8:
            prompt = [rng.randrange(1, 9) for _ in range(rng.randrange(1, 30))]
            seq = Sequence(f"s{next_id}", prompt, SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 20)))
            seq.group_id = seq.seq_id
            sched.add_seq(seq)
            next_id += 1
        live = [s for s in sched.seqs.values() if s.status == SequenceStatus.RUNNING and s.output_token_ids]
        if live and rng.random() < 0.2:
            parent = rng.choice(live)
            child = parent.fork(f"s{next_id}", num_tokens=rng.choice([parent.num_prompt_tokens, parent.num_tokens]))
            next_id += 1
            sched.fork_seq(parent, child)
        if sched.seqs and rng.random() < 0.05:
            sched.finish_seq(rng.choice(sorted(sched.seqs)), SequenceStatus.FINISHED_ABORTED)
        out = sched.schedule()
        runner.update_states(out)
        for sid in out.num_scheduled_tokens:
            s = sched.seqs[sid]
            assert runner.block_tables.block_ids(sid) == kv.block_table(sid)
            st = runner.states[sid]
            assert st.all_token_ids == s.all_token_ids and st.num_computed_tokens == s.num_computed_tokens
        assert set(runner.states) <= set(sched.seqs)
        ids = [
            sid
            for sid, n in out.num_scheduled_tokens.items()
            if sched.seqs[sid].num_computed_tokens + n == sched.seqs[sid].num_tokens
        ]
        toks = [rng.randrange(1, 9) for _ in ids]
        sched.update_from_output(out, ModelRunnerOutput(ids, toks, [None] * len(ids), [None] * len(ids)))
        kv.check_invariants()
    while sched.seqs:
        sched.finish_seq(next(iter(sched.seqs)), SequenceStatus.FINISHED_ABORTED)
    runner.update_states(sched.schedule())
    assert runner.states == {} and kv.num_free_blocks() == kv.num_blocks
