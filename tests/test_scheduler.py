"""The scheduler on plain data: no model, no tensors. What schedule() hands the runner and what
update_from_output() does with the samples it gets back."""

from __future__ import annotations

import dataclasses

import torch

from pagedllm.config import EngineConfig
from pagedllm.kv.paged import PagedKVCacheManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler import Scheduler
from pagedllm.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.sequence import Sequence, SequenceStatus

EOS = 0


def make(
    num_blocks: int = 32, block_size: int = 4, caching: bool = False, **cfg
) -> tuple[Scheduler, PagedKVCacheManager]:
    config = EngineConfig(block_size=block_size, enable_prefix_caching=caching, **cfg)
    kv = PagedKVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(config, kv, max_model_len=256), kv


def seq(seq_id: str, prompt_len: int, max_tokens: int = 8, first: int = 1, **kw) -> Sequence:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    sp.all_stop_token_ids = {EOS}
    return Sequence(seq_id, list(range(first, first + prompt_len)), sp)


def samples(s: Scheduler, out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """What a runner returns: a token for each scheduled sequence that reaches its last token."""
    ids = [
        sid
        for sid, n in out.num_scheduled_tokens.items()
        if s.seqs[sid].num_computed_tokens + n == s.seqs[sid].num_tokens
    ]
    return ModelRunnerOutput(ids, [token] * len(ids), [None] * len(ids), [None] * len(ids))


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, samples(s, out, token))
    return out


def test_output_is_plain_data():
    s, _ = make()
    s.add_seq(seq("a", 6))
    out = s.schedule()

    def walk(x):
        assert not isinstance(x, (torch.Tensor, Sequence)), f"{type(x).__name__} in SchedulerOutput"
        if dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                if f.name != "sampling_params":
                    walk(getattr(x, f.name))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                walk(v)

    walk(out)


def test_new_sequences_then_only_what_changed():
    s, kv = make()
    s.add_seq(seq("a", 6))
    s.add_seq(seq("b", 9, first=50))
    out = step(s)
    assert [n.seq_id for n in out.new_seqs] == ["a", "b"] and out.cached_seqs == []
    assert out.num_scheduled_tokens == {"a": 6, "b": 9}
    a = out.new_seqs[0]
    assert a.token_ids == list(range(1, 7)) and a.num_computed_tokens == 0 and a.block_ids == kv.block_table("a")
    assert len(out.new_seqs[1].block_ids) == 3
    # Decode: a has 7 tokens (2 blocks hold 8), b 10 (3 blocks hold 12): no new blocks yet.
    out = step(s)
    assert out.new_seqs == [] and out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [(c.seq_id, c.new_token_ids, c.new_block_ids, c.num_computed_tokens) for c in out.cached_seqs] == [
        ("a", [7], [], 6),
        ("b", [7], [], 9),
    ]
    step(s)  # a: 8 tokens computed after this one
    out = step(s)  # a's 9th token opens its third block
    ca = next(c for c in out.cached_seqs if c.seq_id == "a")
    assert ca.new_block_ids == kv.block_table("a")[2:] and len(ca.new_block_ids) == 1


def test_chunked_prefill_within_the_token_budget():
    s, _ = make(max_num_batched_tokens=5)
    s.add_seq(seq("a", 12))
    outs = [step(s) for _ in range(3)]
    assert [o.num_scheduled_tokens["a"] for o in outs] == [5, 5, 2]
    assert [len(o.new_seqs) for o in outs] == [1, 0, 0]
    assert s.seqs["a"].output_token_ids == [7]  # sampled only at the end of the prompt


def test_length_and_stop_token_finish_and_free():
    s, kv = make()
    s.add_seq(seq("a", 5, max_tokens=2))
    s.add_seq(seq("b", 5, first=20))
    step(s)
    step(s, token=EOS)  # a reaches max_tokens; b samples EOS
    assert "a" not in s.seqs and "b" not in s.seqs and not s.has_unfinished_seqs()
    assert kv.num_free_blocks() == kv.num_blocks
    out = s.schedule()
    assert out.finished_seq_ids == {"a", "b"} and out.is_empty


def test_update_reports_samples_with_their_stop_status():
    s, _ = make()
    s.add_seq(seq("a", 5, stop_token_ids=[9]))
    out = s.schedule()
    (r,) = s.update_from_output(out, ModelRunnerOutput(["a"], [9], [None], [None]))
    assert r.appended and r.token_id == 9 and r.finished == SequenceStatus.FINISHED_STOPPED and r.seq.stop_reason == 9


def test_preempted_sequence_is_sent_whole_again():
    s, kv = make(num_blocks=6, block_size=4)
    s.add_seq(seq("a", 8, max_tokens=12))
    s.add_seq(seq("b", 8, max_tokens=12, first=30))
    preempted = None
    for _ in range(12):
        out = step(s)
        if out.preempted_seq_ids:
            preempted = out.preempted_seq_ids
            break
    assert preempted == {"b"} and s.seqs["b"].status == SequenceStatus.PREEMPTED
    while "a" in s.seqs:
        out = step(s)
    out = s.schedule()
    (b,) = out.new_seqs
    assert b.seq_id == "b" and b.num_computed_tokens == 0 and b.token_ids == s.seqs["b"].all_token_ids


def test_fork_shares_blocks_and_the_first_writer_copies():
    s, kv = make(block_size=4)
    a = seq("a", 6, max_tokens=4)
    s.add_seq(a)
    step(s)  # a: 6 prompt tokens computed, one sampled
    child = a.fork("c", num_tokens=6)
    s.fork_seq(a, child)
    shared = list(kv.block_table("a"))
    assert child.num_computed_tokens == 5  # its last prompt token runs again: it samples its own
    out = s.schedule()
    (c,) = out.new_seqs
    assert c.seq_id == "c" and c.block_ids == shared and out.num_scheduled_tokens == {"a": 1, "c": 1}
    # Both write into the shared second block: a (scheduled first) gets a copy, c keeps it.
    (ca,) = out.cached_seqs
    (copy,) = [p for op in out.block_ops if op.kind == "copy" for p in op.pairs]
    assert ca.replaced_blocks == [(1, copy[1])] and copy[0] == shared[1] and kv.block_table("a")[1] == copy[1]


def test_idle_sequences_do_not_run_until_their_owner_appends():
    s, _ = make()
    a = Sequence("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8), auto_append=False)
    s.add_seq(a)
    out = s.schedule()
    (r,) = s.update_from_output(out, samples(s, out))
    assert not r.appended and a.is_idle and a.output_token_ids == []
    assert s.schedule().is_empty
    s.append_token(a, 5)
    assert s.schedule().num_scheduled_tokens == {"a": 1}
