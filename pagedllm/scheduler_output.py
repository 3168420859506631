"""The plain data that crosses from the scheduler to the model runner and back, once per step.

Only ids, counts, token ids and the structured-output bitmask: no tensors, no KV manager, no
sequence objects. The runner keeps its own per-sequence state (tokens, block table, random
generator) and updates it from this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pagedllm.kv.base import BlockOp
from pagedllm.logprobs import Logprob
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewSequenceData:
    """A sequence the runner holds no block table for: first scheduled, or back after being
    preempted or swapped (its blocks moved). Its whole state comes along."""

    seq_id: str
    token_ids: list[int]  # every known token: prompt + generated
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    seed: int | None
    # Its prompt's logprobs are wanted (SamplingParams.prompt_logprobs, not all computed yet): the
    # runner returns them for every prompt position it runs.
    wants_prompt_logprobs: bool = False


@dataclass
class CachedSequenceData:
    """A sequence the runner already holds: what changed since it was last scheduled."""

    seq_id: str
    new_token_ids: list[int]  # tokens appended since (the token sampled last step, or a beam's pick)
    new_block_ids: list[int]  # blocks appended to its table
    # (index in the table, new block): a shared block replaced by its copy (copy-on-write)
    replaced_blocks: list[tuple[int, int]]
    num_computed_tokens: int
    # Its table was cut to this many blocks before new_block_ids (slots of rejected drafts given
    # back: spec_decode/); None: not cut.
    truncate_to: int | None = None


class GrammarBitmask(NamedTuple):
    """The tokens each constrained sequence sampling this step may take (structured outputs)."""

    # seq id -> its row of ``mask``; a speculating sequence's first row: it has one per position
    # it runs (its last token, then each draft), consecutive
    rows: dict[str, int]
    mask: np.ndarray  # int32 [rows, ceil(vocab / 32)]: bit t of a row set when token t is allowed


@dataclass
class SchedulerOutput:
    new_seqs: list[NewSequenceData] = field(default_factory=list)
    cached_seqs: list[CachedSequenceData] = field(default_factory=list)
    # seq id -> tokens it runs this step: token_ids[num_computed : num_computed + n]
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Block copies (copy-on-write) and swaps to execute before the forward, in this order.
    block_ops: list[BlockOp] = field(default_factory=list)
    # Sequences gone since the last step: the runner drops their state.
    finished_seq_ids: set[str] = field(default_factory=set)
    # Sequences whose blocks were taken (preempted): the runner drops their block tables but
    # keeps their generators, so a seeded sequence draws on where it left off.
    preempted_seq_ids: set[str] = field(default_factory=set)
    # seq id -> draft tokens it runs after its last token (speculative decoding): such a sequence
    # runs 1 + len(drafts) positions, and every one of them gives a target token.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # seq id -> how many drafts the draft model proposes for it this step (draft-model
    # speculation): the runner runs the draft model first, then verifies its drafts as above. The
    # scheduler cannot know them: the draft model runs where the caches are.
    num_model_drafts: dict[str, int] = field(default_factory=dict)
    # Set by the engine core after scheduling when sequences with structured outputs sample.
    grammar_bitmask: GrammarBitmask | None = None

    def num_drafts(self, seq_id: str) -> int | None:
        """How many drafts ``seq_id`` runs after its last token this step; None: it does not speculate."""
        drafts = self.spec_token_ids.get(seq_id)
        return len(drafts) if drafts is not None else self.num_model_drafts.get(seq_id)

    @property
    def speculating_seq_ids(self) -> list[str]:
        return [*self.spec_token_ids, *self.num_model_drafts]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class PromptLogprobsChunk(NamedTuple):
    """Prompt logprobs from one step: entries for prompt tokens ``first``, ``first + 1``, ..."""

    first: int
    entries: list[dict[int, Logprob]]  # that position's prompt token, then the top-N


@dataclass
class ModelRunnerOutput:
    """What the runner sampled: one row per sequence that reached the end of its known tokens (a
    speculating sequence: one consecutive row per token it keeps, its accepted drafts then the
    target's own next token); and the prompt logprobs of the prompt positions it ran for
    sequences that want them."""

    seq_ids: list[str]
    token_ids: list[int]
    # log p(token) under the raw model distribution; None where not asked for
    logprobs: list[float | None]
    top_logprobs: list[dict[int, Logprob] | None]  # the chosen token, then the top-N
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls([], [], [], [])

    def extend(self, other: ModelRunnerOutput) -> None:
        """Appends ``other``'s rows (sequences this output has none of)."""
        self.seq_ids.extend(other.seq_ids)
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.top_logprobs.extend(other.top_logprobs)
