"""Token controls: per-request edits of the logits before the penalties and sampling (vLLM's
``allowed_token_ids``, ``bad_words`` and ``logit_bias``), and their checks against a vocabulary.

Order as vLLM's sampler: the allowed-token mask, bad words, then the bias. Logprobs stay those
of the raw distribution (the sampler computes them from the unedited logits).

``allowed_token_ids`` and ``logit_bias`` become tensors once, when the engine admits the request
(``prepare_token_controls``), shared by the request's sequences: a step applies each with one
tensor op per row, whatever the lists' length (rebuilding a tensor from a long list per row per
step slowed every request in the batch).

``bad_words`` follows vLLM: each word is tokenized alone and, if it starts a new word-token with
a leading space, also as " word"; a word of tokens ``w[0..n-1]`` bans ``w[n-1]`` whenever the last
``n - 1`` generated tokens are ``w[0..n-2]`` (a one-token word is always banned). Only generated
tokens count, not the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.runner.seq_state import SeqState
from pagedllm.sampling_params import SamplingParams


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """The token sequences ``words`` ban: each word as it tokenizes at the start of a text, and with
    a leading space when that gives a different first token in as many tokens (the word in the
    middle of a text, for tokenizers whose words carry their space)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return [ids for ids in out if ids]


def check_token_controls(params: SamplingParams, vocab_size: int) -> None:
    """Raises ValueError naming the field when a token id is outside the vocabulary."""
    for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
        if ids and max(ids) >= vocab_size:  # max() in C: the lists may hold a vocabulary's worth
            bad = [t for t in ids if t >= vocab_size]
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}.")


@dataclass(frozen=True)
class TokenMasks:
    """A request's allowed_token_ids and logit_bias as tensors (see the module docstring)."""

    banned: torch.Tensor | None  # bool [vocab]: the tokens allowed_token_ids leaves out
    bias_ids: torch.Tensor | None  # long [k]: logit_bias's token ids
    bias_values: torch.Tensor | None  # float32 [k]: their biases


def prepare_token_controls(params: SamplingParams, vocab_size: int) -> TokenMasks:
    """Builds ``params.token_masks`` (once; ids must be < vocab_size) and returns it."""
    if params.token_masks is not None:
        return params.token_masks
    banned = bias_ids = bias_values = None
    if params.allowed_token_ids is not None:
        banned = torch.ones(vocab_size, dtype=torch.bool)
        banned[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = False
    if params.logit_bias:
        bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
    params.token_masks = TokenMasks(banned, bias_ids, bias_values)
    return params.token_masks


def needs_token_controls(requests: list[SeqState]) -> bool:
    return any(r.sampling_params.has_token_controls for r in requests)


def apply_token_controls(logits: torch.Tensor, requests: list[SeqState]) -> torch.Tensor:
    """Edits ``logits`` [rows, vocab] in place, row i by requests[i]'s controls; returns it."""
    ninf = float("-inf")
    width = logits.shape[1]
    for i, r in enumerate(requests):
        sp = r.sampling_params
        if not sp.has_token_controls:
            continue
        row = logits[i]
        # Built at admission by the engine; here only for params that never passed through one.
        masks = prepare_token_controls(sp, width)
        if masks.banned is not None:
            n = min(width, masks.banned.shape[0])
            row[:n].masked_fill_(masks.banned[:n], ninf)
            row[n:] = ninf  # logits wider than the vocabulary: padding, never an allowed id
        if sp.bad_words_token_ids:
            banned = _banned_last_tokens(sp.bad_words_token_ids, r.output_token_ids)
            if banned:
                row[torch.tensor(banned, dtype=torch.long)] = ninf
        if masks.bias_ids is not None:
            row.index_add_(0, masks.bias_ids, masks.bias_values.to(row.dtype))
    return logits


def _banned_last_tokens(words: list[list[int]], generated: list[int]) -> list[int]:
    banned = []
    for w in words:
        prefix = len(w) - 1
        if prefix > len(generated):
            continue
        if prefix == 0 or generated[-prefix:] == w[:prefix]:
            banned.append(w[-1])
    return banned
