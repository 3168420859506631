"""Logprob: one token's log probability, its rank and text (vLLM's ``vllm.logprobs.Logprob``),
and the shapes of the logprobs a request returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Logprob:
    """``logprob``: log p(token) under the model's raw distribution. ``rank``: 1-based rank of the
    token in that distribution (1 = most likely). ``decoded_token``: the token's own text, filled
    when the request detokenizes."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the chosen token first, then the top-N (ranks 1..N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first, which nothing predicts; then the prompt token
# and the top-N given the prompt before it.
PromptLogprobs = list[dict[int, Logprob] | None]


def logprob_dicts(
    logprobs: torch.Tensor, lse: torch.Tensor, token_ids: list[int], num_top: list[int]
) -> list[dict[int, Logprob]]:
    """Per row of float32 ``logprobs`` (unnormalized: log p = value - ``lse``): {its token: Logprob
    with the token's rank, then the row's top ``num_top[i]`` with ranks 1..N}. A token among the
    top N keeps the rank of its place there (as vLLM, which writes the top-N after it)."""
    vocab = logprobs.shape[1]
    num_top = [vocab if n < 0 else n for n in num_top]  # -1: the whole vocabulary
    targets = torch.tensor(token_ids, dtype=torch.long).unsqueeze(1)
    chosen_vals = logprobs.gather(1, targets)
    # rank = 1 + how many tokens are strictly more likely
    ranks = ((logprobs > chosen_vals).sum(dim=1) + 1).tolist()
    chosen = (chosen_vals - lse).squeeze(1).tolist()
    k = min(max(num_top, default=0), vocab)  # more than the vocabulary: all of it
    top_ids = top_vals = None
    if k > 0:
        vals, idx = logprobs.topk(k, dim=-1)
        top_vals, top_ids = (vals - lse).tolist(), idx.tolist()
    out = []
    for i, t in enumerate(token_ids):
        d = {t: Logprob(chosen[i], ranks[i])}
        n = min(num_top[i], k)
        if n > 0:
            for r, (tid, v) in enumerate(zip(top_ids[i][:n], top_vals[i][:n], strict=True), start=1):
                d[tid] = Logprob(v, r)
        out.append(d)
    return out
