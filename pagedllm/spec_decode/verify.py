"""Greedy verification: which drafts the target model agrees with.

The verifying pass gives the target's token at every position of [last token, d1, ..., dk]: t0
follows the last token, t_i follows d_i. Draft d_{i+1} is accepted while every draft before it was
and t_i == d_{i+1}; the first disagreement's t_i (or, all accepted, the bonus t_k) is the target's
own next token. So the kept tokens are t_0 .. t_a, a = accepted drafts: each one the token greedy
decoding without speculation would have produced at that position.
"""

from __future__ import annotations

from pagedllm.scheduler_output import ModelRunnerOutput


def num_accepted(target_ids: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the target's token at the position before them."""
    a = 0
    while a < len(drafts) and target_ids[a] == drafts[a]:
        a += 1
    return a


def keep_accepted(out: ModelRunnerOutput, spec_token_ids: dict[str, list[int]]) -> ModelRunnerOutput:
    """``out`` with each speculating sequence's rows (one per position run, consecutive) cut to
    the tokens it keeps: its accepted drafts' rows and the row after them. The logprobs of those
    rows are the target pass's own, as without speculation."""
    keep: list[int] = []
    i = 0
    rows = out.seq_ids
    while i < len(rows):
        drafts = spec_token_ids.get(rows[i])
        if drafts is None:
            keep.append(i)
            i += 1
            continue
        a = num_accepted(out.token_ids[i : i + len(drafts) + 1], drafts)
        keep.extend(range(i, i + a + 1))
        i += len(drafts) + 1
    return ModelRunnerOutput(
        [rows[i] for i in keep],
        [out.token_ids[i] for i in keep],
        [out.logprobs[i] for i in keep],
        [out.top_logprobs[i] for i in keep],
        out.prompt_logprobs,
    )
