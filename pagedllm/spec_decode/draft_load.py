"""Loads a speculative config's draft model beside the target, and refuses the drafts the engine
cannot run (ValueError naming why):
- a vocabulary or tokenizer other than the target's: draft token ids would mean other tokens;
- a context shorter than the target's max_model_len: the draft runs at every position the target does;
- a target whose out-of-window KV blocks are released (every layer attends through a sliding
  window): the draft shares the target's block tables, whose released entries hold no block, and
  a draft catching up from an early position would write there;
- tensor parallelism (EngineConfig refuses it: the draft would run on every rank).

The draft runs on the target's device, dtype and kv_cache_dtype, in its own quantization
(speculative_config's "quantization", default "auto": its own form).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pagedllm.config import EngineConfig

if TYPE_CHECKING:
    from pagedllm.engine.builder import LoadedModel
    from pagedllm.runner.model_runner import ModelRunner


def draft_engine_config(config: EngineConfig, max_model_len: int) -> EngineConfig:
    """The engine options the draft loads under: the target's, with the draft's model and quantization."""
    spec = config.speculative
    assert spec is not None and spec.uses_draft_model
    return dataclasses.replace(
        config,
        model=spec.model,
        quantization=spec.quantization,
        revision=None,
        tokenizer=None,
        max_model_len=max_model_len,
        speculative_config=None,
    )


def load_draft_model(config: EngineConfig, target: LoadedModel, target_tokenizer: object | None) -> LoadedModel:
    """The draft of ``config.speculative``, checked against ``target`` (and its tokenizer, if any)."""
    # Imported here: the builder imports this module.
    from pagedllm.engine.builder import load_engine_model, release_window, tokenizer_path
    from pagedllm.tokenizer import load_tokenizer

    if release_window(target.hf_config) is not None:
        raise ValueError(
            "speculative_config: a draft model is not supported with a target whose every layer attends "
            "through a sliding window (its out-of-window KV blocks are released); pass "
            "disable_sliding_window=True or use n-gram speculation."
        )
    draft_config = draft_engine_config(config, target.max_model_len)
    try:
        draft = load_engine_model(draft_config)
    except ValueError as e:
        raise ValueError(f"speculative_config: the draft model {draft_config.model!r}: {e}") from e
    target_vocab = getattr(target.hf_config, "vocab_size", None)
    draft_vocab = getattr(draft.hf_config, "vocab_size", None)
    if target_vocab != draft_vocab:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft_vocab} tokens) differs from the "
            f"target's ({target_vocab}): its token ids would name other tokens."
        )
    if target_tokenizer is not None:
        draft_tokenizer = load_tokenizer(tokenizer_path(draft_config, draft.model_path))
        if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise ValueError(
                "speculative_config: the draft model's tokenizer differs from the target's: the same token "
                "ids would be other tokens."
            )
    return draft


def attach_draft(
    config: EngineConfig, runner: ModelRunner, max_model_len: int, draft: LoadedModel, num_blocks: int
) -> None:
    """Gives ``runner`` (the target's) a proposer over ``draft`` with a cache of ``num_blocks``
    blocks, addressed by the target runner's block tables."""
    from pagedllm.engine.builder import build_runner
    from pagedllm.spec_decode.draft_model import DraftProposer

    draft_runner = build_runner(draft_engine_config(config, max_model_len), draft, num_blocks, 0)
    draft_runner.block_tables = runner.block_tables  # the target's block ids address both caches
    runner.drafter = DraftProposer(draft_runner, config.max_num_batched_tokens)
