"""Rejection sampling of drafts (the speculative sampling papers' rule), which keeps the target
model's distribution exactly.

An n-gram draft, and a draft model's greedy (argmax) draft, is a point mass: q(x) = 1 for the
drafted x, decided by the tokens before it. Draft x at position i is accepted with probability
min(1, p_i(x) / q(x)) = p_i(x); on rejection the token is drawn from the residual max(0, p_i - q),
normalised: p_i with x removed. Every draft accepted, the bonus token is drawn from p_k. Each kept
token is then distributed as p at its position given the tokens before it, as without
speculation (its draws differ, so a seed gives other tokens, reproducibly).
"""

from __future__ import annotations

import torch


def rejection_sample(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
    """The tokens kept: the accepted drafts, then the token drawn after them. ``probs``
    [len(drafts) + 1, vocab]: the target's processed sampling distribution at each position."""
    out: list[int] = []
    for i, x in enumerate(drafts):
        p = probs[i]
        if torch.rand((), generator=generator).item() < p[x].item():
            out.append(x)
            continue
        residual = p.clone()
        residual[x] = 0.0
        if not residual.sum().item() > 0:  # p(x) was 1 but for rounding: x is all there is
            out.append(x)
            continue
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out
