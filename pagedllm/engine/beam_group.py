"""Beam search as a group above the engine core (vLLM's offline shape, Hugging Face's rule).

The prompt runs once as one sequence; its candidates start ``beam_width`` beams that fork off
it, sharing its blocks. Each beam is a sequence whose owner appends its tokens: every step it
runs one token and reports its top candidates, then idles; when every live beam has reported,
the group picks the next beams (beam_search.py): a parent picked once continues itself, picked
again it forks (shared blocks, copy-on-write), not picked it is dropped (blocks freed).
"""

from __future__ import annotations

import itertools

from pagedllm.beam_search import BeamSearchState
from pagedllm.engine.core import EngineCore
from pagedllm.engine.groups import metrics_of
from pagedllm.logprobs import Logprob
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.scheduler import SampledToken
from pagedllm.sequence import Sequence, SequenceStatus


class BeamGroup:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        first: Sequence,
        search: BeamSearchState,
        core: EngineCore,
        registry: dict[str, object],
        tokenizer,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.first = first
        self.search = search
        self.core = core
        self.registry = registry
        self.tokenizer = tokenizer
        first.group_id = request_id
        first.reserved_seats = search.params.beam_width - 1
        self.beams: list[Sequence] = [first]  # live beams, best first
        self.cum_logprob: dict[str, float] = {first.seq_id: 0.0}
        self.logprobs: dict[str, list[dict[int, Logprob]]] = {first.seq_id: []}
        self.candidates: dict[str, dict[int, Logprob]] = {}  # beam id -> its top logprobs this step
        self._ids = itertools.count(1)
        registry[first.seq_id] = self
        core.add_seq(first)

    @property
    def finished(self) -> bool:
        return self.search.done

    @property
    def live_seq_ids(self) -> list[str]:
        return [b.seq_id for b in self.beams]

    def on_sample(self, sample: SampledToken, now: float) -> None:
        self.candidates[sample.seq.seq_id] = sample.top_logprobs or {}
        if len(self.candidates) == len(self.beams):
            self._advance()

    def has_output(self) -> bool:
        return self.search.done  # a beam search reports once, at the end

    def _advance(self) -> None:
        """Every live beam has its candidates: pick the next beams, fork / drop, or finish."""
        beams = self.beams
        tops = [self.candidates[b.seq_id] for b in beams]
        self.candidates.clear()
        nxt = self.search.step(
            [(self.cum_logprob[b.seq_id], t) for b, t in zip(beams, tops, strict=True)],
            [(b.output_token_ids, self.logprobs[b.seq_id]) for b in beams],
        )
        if self.search.done:
            nxt = []
        # A parent picked once continues as itself; picked again, it forks first (the child
        # shares its blocks, before the parent's new token is appended); never picked, dropped.
        picked: set[int] = set()
        new_beams: list[tuple[Sequence, int]] = []
        for j, cand in enumerate(nxt):
            parent = beams[cand.beam]
            if cand.beam not in picked:
                picked.add(cand.beam)
                new_beams.append((parent, j))
                continue
            child = self.core.fork_seq(parent, f"{self.request_id}#beam{next(self._ids)}")
            self.registry[child.seq_id] = self
            self.logprobs[child.seq_id] = list(self.logprobs[parent.seq_id])
            new_beams.append((child, j))
        for b, beam in enumerate(beams):
            if b not in picked:
                self._drop(beam)
        for beam, j in new_beams:
            cand = nxt[j]
            self.core.append_token(beam, cand.token)
            self.cum_logprob[beam.seq_id] = cand.cum_logprob
            self.logprobs[beam.seq_id].append(tops[cand.beam])
            beam.reserved_seats = 0
        self.beams = [beam for beam, _ in new_beams]

    def _drop(self, beam: Sequence) -> None:
        self.core.finish_seq(beam.seq_id, SequenceStatus.FINISHED_ABORTED)
        self.registry.pop(beam.seq_id, None)
        self.cum_logprob.pop(beam.seq_id, None)
        self.logprobs.pop(beam.seq_id, None)

    def abort(self) -> None:
        for beam in self.beams:
            self._drop(beam)
        self.beams = []

    def make_output(self) -> RequestOutput:
        """A finished beam search's hypotheses, best first (text without an ending EOS, as vLLM)."""
        completions = []
        for i, (hyp, toks, lps) in enumerate(self.search.finished):
            shown = toks[:-1] if hyp.finish_reason == "stop" else toks
            completions.append(
                CompletionOutput(
                    index=i,
                    text=self.tokenizer.decode(shown) if self.tokenizer is not None else "",
                    token_ids=list(toks),
                    cumulative_logprob=hyp.cum_logprob,
                    logprobs=list(lps),
                    finish_reason=hyp.finish_reason,
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.first.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            metrics=metrics_of(self.first),
            num_cached_tokens=self.first.num_cached_tokens,
        )
