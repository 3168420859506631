"""The group layer above the engine core: one user request as one or more sequences.

``SampleGroup`` serves n = 1 and parallel sampling (n > 1, best_of): sequence 0 runs the prompt;
when it samples its first token, the other sequences fork off it at the prompt (sharing its
blocks, copy-on-write) and each runs the prompt's last token again to draw its own first token
with its own seed. Each sequence detokenizes incrementally and stops on its own.
Beam search is the other group (beam_group.py). Both report to LLMEngine through the same three
calls: ``on_sample`` after a step, ``has_output`` / ``make_output`` for what to return.
"""

from __future__ import annotations

from pagedllm.engine.core import EngineCore
from pagedllm.logprobs import SampleLogprobs
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.scheduler import SampledToken
from pagedllm.sequence import Sequence, SequenceStatus, child_seed
from pagedllm.tokenizer import IncrementalDetokenizer, TokenTexts


class SeqOutput:
    """What a sequence's output accumulates: text, logprobs."""

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer | None) -> None:
        self.seq = seq
        self.detokenizer = detokenizer
        self.cumulative_logprob = 0.0
        self.logprobs: SampleLogprobs | None = [] if seq.sampling_params.logprobs is not None else None


def metrics_of(seq: Sequence) -> dict[str, float]:
    metrics = {"arrival_time": seq.arrival_time}
    for k in ("first_scheduled_time", "first_token_time", "last_token_time", "finished_time"):
        v = getattr(seq, k)
        if v is not None:
            metrics[k] = v
    return metrics


class SampleGroup:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        first: Sequence,
        core: EngineCore,
        registry: dict[str, object],
        tokenizer,
        token_texts: TokenTexts | None = None,
    ) -> None:
        sp = first.sampling_params
        self.request_id = request_id
        self.prompt = prompt
        self.core = core
        self.registry = registry
        self.tokenizer = tokenizer
        # Logprob.decoded_token, when the request detokenizes
        self.token_texts = token_texts if sp.detokenize else None
        self._prompt_logprobs_decoded = False
        self.num_seqs = max(sp.n, sp.best_of or 1)
        if self.num_seqs > 1:
            first.group_id = request_id
            first.reserved_seats = self.num_seqs - 1
        self.outputs = [self._track(first)]
        core.add_seq(first)

    def _track(self, seq: Sequence) -> SeqOutput:
        sp = seq.sampling_params
        detok = None
        if sp.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                sp.skip_special_tokens,
                sp.stop,
                sp.include_stop_str_in_output,
                spaces_between_special_tokens=sp.spaces_between_special_tokens,
            )
        self.registry[seq.seq_id] = self
        return SeqOutput(seq, detok)

    @property
    def live_seq_ids(self) -> list[str]:
        return [o.seq.seq_id for o in self.outputs if not o.seq.is_finished]

    @property
    def finished(self) -> bool:
        return len(self.outputs) == self.num_seqs and all(o.seq.is_finished for o in self.outputs)

    def on_sample(self, sample: SampledToken, now: float) -> None:
        seq = sample.seq
        out = next(o for o in self.outputs if o.seq is seq)
        if len(self.outputs) < self.num_seqs and seq is self.outputs[0].seq:
            self._fork_the_others(seq, now)
        if sample.logprob is not None:
            out.cumulative_logprob += sample.logprob
        if out.logprobs is not None:
            if self.token_texts is not None:
                self.token_texts.fill(sample.top_logprobs)
            out.logprobs.append(sample.top_logprobs)
        sp = seq.sampling_params
        # A token that ends generation (EOS, stop_token_ids) adds no text, as in vLLM, unless the
        # stop is asked to be in the output; the token that completes a structured output does,
        # the one a failed constraint ends on never does (it may be one the constraint rejected).
        stopped_by_token = sample.finished == SequenceStatus.FINISHED_STOPPED and (
            sample.token_id in sp.stop_token_ids or sample.token_id in sp.all_stop_token_ids
        )
        constraint_failed = sample.finished is not None and seq.grammar is not None and seq.grammar.failed
        shown = not constraint_failed and (not stopped_by_token or sp.include_stop_str_in_output)
        if out.detokenizer is not None and shown:
            # stop strings, like stop tokens, only count once min_tokens are out
            stop_str = out.detokenizer.add_token(sample.token_id, check_stop=seq.num_output_tokens >= sp.min_tokens)
            if stop_str is not None:
                seq.stop_reason = stop_str
                if sample.output_index is not None:
                    seq.truncate_output(sample.output_index + 1)  # a speculated run's later tokens
                if seq.is_finished:
                    seq.status = SequenceStatus.FINISHED_STOPPED
                else:
                    self.core.finish_seq(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
        last = sample.output_index is None or sample.output_index == seq.num_output_tokens - 1
        if seq.is_finished and last:  # (a speculated run's earlier samples come before it)
            self.registry.pop(seq.seq_id, None)

    def _fork_the_others(self, first: Sequence, now: float) -> None:
        """Sequence 0 sampled its first token: the others fork off it at the prompt, each to draw
        its own first token from the same distribution (its last prompt token runs again)."""
        first.reserved_seats = 0
        seed = first.sampling_params.seed
        for i in range(1, self.num_seqs):
            child = self.core.fork_seq(
                first,
                f"{self.request_id}#{i}",
                num_tokens=first.num_prompt_tokens,
                seed=None if seed is None else child_seed(seed, i),
            )
            child.first_token_time = now  # the prompt counts once, for sequence 0
            self.outputs.append(self._track(child))

    def abort(self) -> None:
        for seq_id in self.live_seq_ids:
            self.core.finish_seq(seq_id, SequenceStatus.FINISHED_ABORTED)
            self.registry.pop(seq_id, None)

    def has_output(self) -> bool:
        return True

    def _completion(self, index: int, out: SeqOutput) -> CompletionOutput:
        seq = out.seq
        finished = seq.is_finished
        text = ""
        d = out.detokenizer
        if d is not None:
            # While running, hold back a tail that may turn out to start a stop string, so the
            # cumulative text only ever grows (safe to stream as deltas).
            text = d.text[: d.stream_safe_len(finished)]
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=out.cumulative_logprob if seq.sampling_params.needs_logprobs else None,
            logprobs=list(out.logprobs) if out.logprobs is not None else None,
            finish_reason=seq.status.value if finished else None,
            stop_reason=seq.stop_reason if finished else None,
        )

    def make_output(self) -> RequestOutput:
        first = self.outputs[0].seq
        sp = first.sampling_params
        completions = [self._completion(i, o) for i, o in enumerate(self.outputs)]
        if self.token_texts is not None and first.prompt_logprobs is not None and not self._prompt_logprobs_decoded:
            # All in by the first sample, which comes before any output: decoded once.
            for entry in first.prompt_logprobs:
                self.token_texts.fill(entry)
            self._prompt_logprobs_decoded = True
        if len(completions) > sp.n:
            # best_of: the n sequences with the highest cumulative logprob (vLLM's rule).
            completions = sorted(completions, key=lambda c: -(c.cumulative_logprob or 0.0))[: sp.n]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            metrics=metrics_of(first),
            num_cached_tokens=first.num_cached_tokens,
            # Complete by the first sample (the prompt has run), and unchanged after: the list
            # itself, not a copy per streamed output.
            prompt_logprobs=first.prompt_logprobs,
        )
