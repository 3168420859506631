"""Beam search: vLLM's offline shapes, Hugging Face ``generate(num_beams=k)``'s selection rule.

The engine runs each beam as a sequence; beams fork from their parent's block table (shared
blocks, copy-on-write on the partly filled last one) and dropped beams free theirs. This module
holds only the bookkeeping of one prompt's search: given every live beam's top candidates, it
picks the next beams and the finished hypotheses, exactly as transformers' ``_beam_search``
does for one batch item (v4.50+ vectorised implementation):

* each step keeps the top ``K = max(2, 1 + #eos) * beam_width`` continuations over all beams by
  cumulative logprob; the best ``beam_width`` of them that do not end (EOS, or the length limit)
  are the next beams;
* a continuation among the top ``beam_width`` that ends becomes a finished hypothesis scored
  ``cum_logprob / generated_len ** length_penalty`` (the generated length counts the EOS); the
  best ``beam_width`` hypotheses are kept;
* the search stops when every continuation ends (length limit); with ``early_stopping=True`` as
  soon as ``beam_width`` hypotheses exist; otherwise once they do and the best running beam
  cannot beat the worst of them: its score normalised by the current generated length
  (``False``), or by ``max_tokens`` when ``early_stopping="never"`` and ``length_penalty > 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.logprobs import Logprob


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams, plus Hugging Face's ``early_stopping`` (default False, as in HF).

    ``temperature`` > 0 scores candidates by the logprobs of the tempered distribution
    (logits / temperature); 0 (default) uses the model's raw distribution, as HF's beam search.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}.")
        es = self.early_stopping
        if not (es is True or es is False or es == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}.")


@dataclass
class BeamSearchSequence:
    """One finished beam: ``tokens`` is prompt + generated (an ending EOS included), ``text`` the
    generated text (without that EOS), ``cum_logprob`` the sum of the generated tokens' logprobs."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None
    # Hugging Face's sequences_scores: cum_logprob / len(generated) ** length_penalty.
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """The result of one prompt: ``sequences`` best first (``beam_width`` of them)."""

    sequences: list[BeamSearchSequence]


@dataclass
class Candidate:
    beam: int  # index of the parent among the live beams
    token: int
    logprob: float
    cum_logprob: float


@dataclass
class Hypothesis:
    score: float
    cum_logprob: float
    beam: int  # parent's index among the live beams at the step it finished
    token: int
    logprob: float
    finish_reason: str


class BeamSearchState:
    """The selection rule of one prompt's search (no tensors, no KV: the engine does those)."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: set[int]) -> None:
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        self.num_generated = 0
        self.done = False
        # Finished hypotheses, best first, each with the tokens / logprobs it generated.
        self.finished: list[tuple[Hypothesis, list[int], list[dict[int, Logprob]]]] = []

    def step(
        self,
        beams: list[tuple[float, dict[int, Logprob]]],
        histories: list[tuple[list[int], list[dict[int, Logprob]]]],
    ) -> list[Candidate]:
        """One step. ``beams``: per live beam, (cumulative logprob, its top candidates token ->
        logprob); ``histories``: per live beam, (generated tokens, their logprob dicts) so far.
        Returns the next beams (best first); sets ``done`` when the search is over."""
        p = self.params
        width = p.beam_width
        cands = [
            Candidate(b, tok, lp.logprob, cum + lp.logprob)
            for b, (cum, top) in enumerate(beams)
            for tok, lp in top.items()
        ]
        # Best first; ties by beam then token, like topk over the flattened (beam, vocab) scores.
        cands.sort(key=lambda c: (-c.cum_logprob, c.beam, c.token))
        cands = cands[: self.num_candidates]
        gen_len = self.num_generated + 1
        ends = [c.token in self.eos_token_ids or gen_len >= p.max_tokens for c in cands]
        running = [c for c, e in zip(cands, ends, strict=True) if not e][:width]
        # Only the top beam_width continuations may finish (the rest are spares to keep width).
        for c, e in zip(cands[:width], ends[:width], strict=True):
            if not e:
                continue
            reason = "stop" if c.token in self.eos_token_ids else "length"
            hyp = Hypothesis(
                c.cum_logprob / gen_len**p.length_penalty, c.cum_logprob, c.beam, c.token, c.logprob, reason
            )
            toks, lps = histories[c.beam]
            self.finished.append((hyp, [*toks, c.token], [*lps, beams[c.beam][1]]))
        self.finished.sort(key=lambda f: -f[0].score)  # stable: earlier hypotheses win ties
        del self.finished[width:]
        self.num_generated = gen_len
        if all(ends):
            self.done = True
        elif len(self.finished) == width:
            if p.early_stopping is True:
                self.done = True
            else:
                length = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else gen_len
                best_possible = running[0].cum_logprob / length**p.length_penalty
                if not best_possible > self.finished[-1][0].score:
                    self.done = True
        return running
