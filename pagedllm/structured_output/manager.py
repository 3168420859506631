"""StructuredOutputManager: compiled grammars (cached), one matcher per sequence, and the token
bitmask of each step.

As in vLLM, the constraint is a bitmask over the vocabulary per constrained sequence and step,
computed on the host from each sequence's matcher and applied to its logits before sampling;
the KV cache and the forward are untouched. Matchers advance on the engine's side as tokens are
appended (Sequence.append_output_token), so the runner only ever sees the mask.

Compiling is done once per distinct constraint (cached, least recently used evicted): the
server compiles in its request handlers, off the step loop, and a step only copies a compiled
matcher. Masks of a step's sequences are computed by llguidance's thread pool at once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import numpy as np

from pagedllm.structured_output.grammar import compile_error, grammar_text
from pagedllm.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("pagedllm")

CACHE_SIZE = 256  # distinct constraints kept compiled


class GrammarState:
    """One sequence's matcher: the tokens it accepted so far, and what it allows next."""

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template  # the compiled constraint before any token
        self.matcher = template.deep_copy()
        self.num_accepted = 0
        self.failed = False  # a token it could not accept: it no longer constrains (logged)

    def accept(self, token_id: int) -> None:
        if self.failed:
            return
        if not self.matcher.consume_token(token_id):
            self.failed = True
            error = self.matcher.get_error()
            logger.warning("pagedllm: structured output could not accept token %d: %s", token_id, error)
            return
        self.num_accepted += 1

    @property
    def is_terminated(self) -> bool:
        """The output is complete: nothing but end-of-sequence may follow."""
        return not self.failed and self.matcher.is_stopped()

    @property
    def constrains(self) -> bool:
        return not self.failed and not self.matcher.is_stopped()

    def fork(self, output_token_ids: list[int]) -> GrammarState:
        """The state of a sequence holding these output tokens (a fork of this one's)."""
        child = GrammarState(self._template)
        if len(output_token_ids) == self.num_accepted and not self.failed:
            child.matcher = self.matcher.deep_copy()
            child.num_accepted = self.num_accepted
        else:
            for t in output_token_ids:
                child.accept(t)
        return child


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        """``tokenizer``: the engine's (a transformers fast tokenizer); ``vocab_size``: the width of
        the model's logits (may exceed the tokenizer's: padding rows are never allowed)."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = eos_token_id
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[tuple[str, str, bool], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.words = (vocab_size + 31) // 32  # int32 words per mask row

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        # Built on first use (~1 s for a 50k vocabulary), not when an engine starts.
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                    )
                except Exception as e:  # a slow tokenizer, or one llguidance cannot read
                    raise ValueError(f"structured outputs need a fast (Rust) tokenizer: {e}") from e
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled constraint (cached); ValueError with the grammar's error if it cannot run."""
        key = params.key()
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        tokenizer = self.tokenizer
        grammar = grammar_text(params)
        error = compile_error(grammar, tokenizer)
        if error is not None:
            raise ValueError(f"structured outputs: the {params.kind} constraint cannot be compiled: {error}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            error = matcher.get_error()
            raise ValueError(f"structured outputs: the {params.kind} constraint cannot be compiled: {error}")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.compile(params))

    def bitmask(self, states: list[GrammarState]) -> np.ndarray:
        """int32 [len(states), words]: bit t of row i set when states[i] allows token t next."""
        mask = np.full((len(states), self.words), -1, dtype=np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(s.matcher, i) for i, s in enumerate(states)], mask.ctypes.data, self.words * 4, len(states)
        )
        return mask
