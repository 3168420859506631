"""StructuredOutputManager: compiled grammars, one matcher per sequence, and the token masks of
each step.

As in vLLM, the constraint is a bitmask over the vocabulary per constrained sequence and step,
computed on the host from each sequence's matcher and applied to its logits before sampling;
the KV cache and the forward are untouched. Matchers advance on the engine's side as tokens are
appended (Sequence.append_output_token), so the runner only ever sees the mask.

Compiling (compiler.py) happens once per distinct constraint, in its own threads, before the
request reaches the engine. Masks (state.py) are computed ahead, in mask threads, as soon as a
sequence accepts a token; a step waits for outstanding masks only a fraction of a step's time
(``settle``), and sequences whose mask is not in yet sit that step out.
"""

from __future__ import annotations

import concurrent.futures
import os
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np

from pagedllm.structured_output.compiler import GrammarCompiler
from pagedllm.structured_output.grammar import CompiledGrammar, compute_mask
from pagedllm.structured_output.limits import CompileSettings, lower_thread_priority
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.structured_output.state import GrammarState

__all__ = ["StructuredOutputManager", "GrammarState"]


class StructuredOutputManager:
    def __init__(
        self, tokenizer, vocab_size: int, eos_token_id: int | None, settings: CompileSettings | None = None
    ) -> None:
        """``tokenizer``: the engine's (a transformers fast tokenizer); ``vocab_size``: the width of
        the model's logits (may exceed the tokenizer's: padding rows are never allowed)."""
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_id, settings or CompileSettings.from_env())
        self.vocab_size = vocab_size
        self.words = self.compiler.words  # int32 words per mask row
        self._eos_row = np.zeros(self.words, dtype=np.int32)
        if eos_token_id is not None and 0 <= eos_token_id < vocab_size:
            self._eos_row.view(np.uint32)[eos_token_id // 32] = np.uint32(1 << (eos_token_id % 32))
        self._eos_row.flags.writeable = False
        self._pending: set[GrammarState] = set()  # engine thread only
        self._mask_pool: ThreadPoolExecutor | None = None
        self.mask_threads = max(1, min(4, (os.cpu_count() or 2) // 4))

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        return self.compiler.tokenizer

    # ---- compiling (any thread) ------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, compiled in this thread if not cached; GrammarError if it cannot run."""
        return self.compiler.compile(params)

    async def compile_async(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint from the compile threads (see GrammarCompiler.compile_async)."""
        return await self.compiler.compile_async(params)

    # ---- the engine thread -----------------------------------------------------------------
    def new_state(self, params: StructuredOutputsParams, compiled: CompiledGrammar | None = None) -> GrammarState:
        """A sequence's state; ``compiled``: the constraint compiled already (the server's path),
        else it is compiled here (the offline LLM's, whose caller is the engine's thread)."""
        return GrammarState(compiled or self.compile(params), self._submit, self._eos_row)

    def _submit(self, state: GrammarState) -> Future:
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(self.mask_threads, "pagedllm-mask", initializer=lower_thread_priority)
        self._pending.add(state)
        return self._mask_pool.submit(self._compute_mask, state.matcher)

    def _compute_mask(self, matcher: llguidance.LLMatcher) -> tuple[np.ndarray, bool]:
        mask = compute_mask(matcher, self.words)
        return mask, matcher.is_error()

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def settle(self, timeout: float) -> None:
        """Takes in the masks that are done, after waiting up to ``timeout`` s for the rest."""
        if not self._pending:
            return
        if timeout > 0:
            futures = [s.future for s in self._pending if s.future is not None]
            concurrent.futures.wait(futures, timeout=timeout)
        self._pending = {s for s in self._pending if not s.poll()}

    def wait_any(self, timeout: float) -> None:
        """Waits until a mask is done (or ``timeout`` s): a step that had nothing else to run."""
        futures = [s.future for s in self._pending if s.future is not None]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def bitmask(self, states: list[GrammarState], num_drafts: list[int] | None = None) -> np.ndarray:
        """int32 [rows, words]: bit t of a row set when its state allows token t next (waits for a
        mask still being computed: scheduling holds such sequences back, so only a rare path gets
        here with one). One row per state, or 1 + ``num_drafts[i]`` rows for states[i] when it
        speculates: the masks of its verifying positions (GrammarState.position_masks)."""
        if num_drafts is None:
            num_drafts = [0] * len(states)
        mask = np.empty((len(states) + sum(num_drafts), self.words), dtype=np.int32)
        row = 0
        for s, d in zip(states, num_drafts, strict=True):
            if d:
                for m in s.position_masks(d):
                    mask[row] = m
                    row += 1
                continue
            if s.mask is None:
                s.wait()
            mask[row] = s.mask
            row += 1
        return mask

    def shutdown(self) -> None:
        self.compiler.shutdown()
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=False, cancel_futures=True)
