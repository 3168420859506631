"""Token-level stop conditions of a sequence (stop strings are the detokenizer's job)."""

from __future__ import annotations

from pagedllm.sequence import Sequence, SequenceStatus
from pagedllm.structured_output.state import STOP_REASON as STRUCTURED_OUTPUT_ERROR


def check_stop(seq: Sequence, max_model_len: int) -> SequenceStatus | None:
    """The finished status its last token gives the sequence, or None to go on.

    Sets ``seq.stop_reason`` to the stop token id (None for EOS) when it stops on a token."""
    sp = seq.sampling_params
    last = seq.output_token_ids[-1]
    if seq.grammar is not None and seq.grammar.failed:
        # Its constraint failed (a rejected token, a parser limit): it must not go on unconstrained.
        seq.stop_reason = STRUCTURED_OUTPUT_ERROR
        return SequenceStatus.FINISHED_STOPPED
    if seq.num_output_tokens >= sp.min_tokens:
        if not sp.ignore_eos and last in sp.all_stop_token_ids:
            seq.stop_reason = None
            return SequenceStatus.FINISHED_STOPPED
        if last in sp.stop_token_ids:
            seq.stop_reason = last
            return SequenceStatus.FINISHED_STOPPED
    if seq.grammar is not None and seq.grammar.is_terminated:
        # Its structured output is complete: nothing but end-of-sequence could follow.
        seq.stop_reason = None
        return SequenceStatus.FINISHED_STOPPED
    if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH
    return None
