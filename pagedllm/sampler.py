"""Turns the last-position logits of each sampling sequence into next tokens (+ logprobs).

Order as in vLLM: the structured-output mask, token controls (allowed_token_ids, bad_words,
logit_bias: token_controls.py), penalties, min_tokens masking, then greedy argmax or temperature
-> top-k -> top-p -> min-p -> random draw. Logprobs are those of the model's raw distribution
(before the mask: what the model thinks of each token, not what it was allowed).
Random draws use the exponential-race trick (argmax p / Exp(1)), with a per-sequence
generator when the sequence has a seed, so its tokens do not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.logprobs import Logprob, logprob_dicts
from pagedllm.runner.seq_state import SeqState
from pagedllm.token_controls import apply_token_controls, needs_token_controls


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # log p(token) under the raw model distribution; None for every row when no row needs logprobs
    chosen_logprobs: list[float | None]
    top_logprobs: list[dict[int, Logprob] | None]  # per row: the chosen token, then the top-N

    @classmethod
    def of_tokens(cls, ids: list[int]) -> SamplerOutput:
        """Tokens alone, one per sequence given (no logprobs)."""
        return cls(ids, [None] * len(ids), [None] * len(ids))


class AllowedTokens(NamedTuple):
    """Structured outputs' masks for some rows of a step's logits."""

    rows: list[int]  # rows of the logits
    bitmask: np.ndarray  # int32 [len(rows), ceil(vocab / 32)]: bit t set when token t is allowed

    def apply(self, logits: torch.Tensor, kernel: Callable | None = None) -> None:
        """Sets every disallowed token's logit of those rows to -inf, in place. ``kernel``: the
        compiled one (pagedllm.kernels' apply_token_bitmask), else torch's masked_fill."""
        if kernel is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
            kernel(logits, torch.from_numpy(self.bitmask), torch.tensor(self.rows, dtype=torch.long))
            return
        vocab = logits.shape[1]
        # Bits inverted while packed (32x fewer bytes), then unpacked straight into a bool mask.
        banned = np.unpackbits(~self.bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        banned_t = torch.from_numpy(banned).view(torch.bool)
        first, n = self.rows[0], len(self.rows)
        if self.rows == list(range(first, first + n)):  # the usual case: a run of rows, masked in place
            logits[first : first + n].masked_fill_(banned_t, float("-inf"))
        else:
            rows = torch.tensor(self.rows, dtype=torch.long)
            logits[rows] = logits[rows].masked_fill(banned_t, float("-inf"))


class Sampler:
    def __init__(
        self,
        seed: int = 0,
        argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
        apply_token_bitmask: Callable | None = None,
    ) -> None:
        """``argmax_rows`` / ``apply_token_bitmask``: the compiled row argmax and structured-output
        masking (pagedllm.kernels), or None for torch's."""
        self.apply_token_bitmask = apply_token_bitmask
        # Draws for requests without their own seed: reproducible per engine, not per request.
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self.argmax_rows = argmax_rows

    def __call__(
        self, logits: torch.Tensor, requests: list[SeqState], allowed: AllowedTokens | None = None
    ) -> SamplerOutput:
        """``logits`` in any float dtype: an all-greedy batch without logprobs, penalties or
        structured outputs takes the argmax of the model's own (bf16) logits, which is the argmax
        of their float copy. ``allowed``: the structured-output masks of constrained rows."""
        if allowed is None and _greedy_without_extras(requests):
            return SamplerOutput.of_tokens(self._greedy(logits).tolist())
        want_logprobs = any(r.needs_logprobs for r in requests)
        penalties = _needs_penalties(requests)
        controls = needs_token_controls(requests)
        logits = logits.float()
        processed = logits.clone() if penalties or controls or allowed is not None else logits
        if allowed is not None:
            allowed.apply(processed, self.apply_token_bitmask)
        if controls:
            apply_token_controls(processed, requests)
        if penalties:
            self._apply_penalties(processed, requests)
        token_ids = self._choose(processed, requests)
        if not want_logprobs:
            return SamplerOutput.of_tokens(token_ids.tolist())
        # Logprobs are of the raw distribution (tempered for beam rows that ask): log p = logit - lse.
        # Only rows that return top-N logprobs get a full log-softmax; the rest need one logsumexp.
        temps = torch.tensor([r.sampling_params.logprob_temperature for r in requests], dtype=logits.dtype).unsqueeze(1)
        scored = logits if bool((temps == 1.0).all()) else logits / temps
        lse = torch.logsumexp(scored, dim=-1, keepdim=True)
        chosen = (scored.gather(1, token_ids.unsqueeze(1)) - lse).squeeze(1)
        ids = token_ids.tolist()
        chosen_l = chosen.tolist()
        top: list[dict[int, Logprob] | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if rows:
            sel = torch.tensor(rows, dtype=torch.long)
            ks = [requests[i].sampling_params.logprobs for i in rows]
            dicts = logprob_dicts(scored[sel], lse[sel], [ids[i] for i in rows], ks)
            for i, d in zip(rows, dicts, strict=True):
                top[i] = d
        return SamplerOutput(ids, chosen_l, top)

    @staticmethod
    def target_probs(logits: torch.Tensor, requests: list[SeqState]) -> torch.Tensor:
        """The distribution each row's token is drawn from, as ``__call__`` draws a random row:
        token controls, temperature, top-k, top-p, min-p (speculative rejection sampling; no
        penalties: sequences with them do not speculate)."""
        logits = logits.float().clone()
        if needs_token_controls(requests):
            apply_token_controls(logits, requests)
        params = [r.sampling_params for r in requests]
        logits /= torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
        return torch.softmax(_filter(logits, params), dim=-1)

    @staticmethod
    def argmax_only(requests: list[SeqState]) -> bool:
        """Whether this step's samples are the argmax of the logits and nothing else: every sequence
        greedy, no logprobs, no penalties, no token controls. Then the model may hand over token ids
        (LlamaForCausalLM.greedy_tokens) instead of logits."""
        return _greedy_without_extras(requests)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        if (
            self.argmax_rows is not None
            and logits.dtype in (torch.bfloat16, torch.float32)
            and logits.device.type == "cpu"
            and logits.stride(-1) == 1
        ):
            return self.argmax_rows(logits)
        # max().indices is argmax (first maximum on ties) but ~3x faster on the CPU
        return logits.max(dim=-1).indices

    # ---- logits processing ---------------------------------------------------------------
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[SeqState]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, r in enumerate(requests):
            sp = r.sampling_params
            row = logits[i]
            if sp.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
            if (sp.frequency_penalty or sp.presence_penalty) and r.output_token_ids:
                counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=vocab)
                row -= sp.frequency_penalty * counts[:vocab].to(row.dtype)
                row -= sp.presence_penalty * (counts[:vocab] > 0).to(row.dtype)
            if r.num_output_tokens < sp.min_tokens:
                stops = set(sp.stop_token_ids)
                if not sp.ignore_eos:
                    stops |= sp.all_stop_token_ids
                stops = [t for t in stops if t < vocab]
                if stops:
                    row[torch.tensor(stops, dtype=torch.long)] = float("-inf")
        return logits

    def _choose(self, logits: torch.Tensor, requests: list[SeqState]) -> torch.Tensor:
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if not random_rows:
            return self._greedy(logits)
        if len(random_rows) == len(requests):
            out, sub = None, logits
        else:
            out = self._greedy(logits)
            rows = torch.tensor(random_rows, dtype=torch.long)
            sub = logits[rows]
        params = [requests[i].sampling_params for i in random_rows]
        if any(p.temperature != 1.0 for p in params):
            sub = sub / torch.tensor([p.temperature for p in params], dtype=sub.dtype).unsqueeze(1)
        probs = torch.softmax(_filter(sub, params), dim=-1)
        # Exponential race: argmax p / E with E ~ Exp(1) drawn per token, each row from its own
        # generator (a seeded request's tokens do not depend on its batch). Masking a token only
        # changes the draw if that token would have won (min_tokens, stop ids, top-k keep the
        # other draws). E = -log U: uniform_ + one vectorized log is 6x faster than exponential_.
        q = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            q[j].uniform_(generator=requests[i].generator or self.generator)
        chosen = probs.div_(q.log_().neg_()).max(dim=-1).indices
        if out is None:
            return chosen
        out[rows] = chosen
        return out


def _greedy_without_extras(requests: list[SeqState]) -> bool:
    return (
        not any(r.needs_logprobs for r in requests)
        and not _needs_penalties(requests)
        and not needs_token_controls(requests)
        and all(r.sampling_params.greedy for r in requests)
    )


def _needs_penalties(requests: list[SeqState]) -> bool:
    for r in requests:
        sp = r.sampling_params
        if sp.repetition_penalty != 1.0 or r.num_output_tokens < sp.min_tokens:
            return True
        if (sp.frequency_penalty or sp.presence_penalty) and r.output_token_ids:
            return True
    return False


def _filter(logits: torch.Tensor, params) -> torch.Tensor:
    """Applies top-k, top-p and min-p (each row its own values); removed entries become -inf."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    vocab = logits.shape[1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k]).unsqueeze(1)
        remove |= torch.arange(vocab).unsqueeze(0) >= k
        p = torch.tensor(top_p, dtype=logits.dtype).unsqueeze(1)
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p (the first always stays).
        remove |= (probs.cumsum(dim=-1) - probs) >= p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    if any(m > 0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        m = torch.tensor(min_p, dtype=logits.dtype).unsqueeze(1)
        logits = logits.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits
