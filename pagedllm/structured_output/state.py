"""GrammarState: one sequence's matcher, and the mask of its next token, computed ahead.

When a sequence accepts a token, the mask of its next one is computed at once in a mask thread
(masks.py), while the engine finishes the step and schedules the next; a sequence is scheduled
to sample only once its mask is in (Sequence.waits_for_mask), so one expensive constraint slows
its own sequences, never a step everyone waits for.

A matcher that fails (a sampled token it rejects, or a parser limit such as llguidance's items
per row) never stops constraining silently: from then on only end-of-sequence is allowed and
the sequence ends with stop_reason STOP_REASON. One warning is logged per request, without the
grammar or the error's text (both are the client's content).
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from pagedllm.structured_output.grammar import CompiledGrammar

logger = logging.getLogger("pagedllm")

# The stop_reason of a sequence whose constraint failed (its finish_reason is "stop").
STOP_REASON = "structured_output_error"

# The masks' executor: submit(state) -> a future of (mask row, whether the matcher failed).
SubmitMask = Callable[["GrammarState"], Future]


class _Report:
    """Shared by a request's sequences (forks): its failure is logged once."""

    logged = False


class GrammarState:
    def __init__(
        self, compiled: CompiledGrammar, submit: SubmitMask, eos_row: np.ndarray, report: _Report | None = None
    ) -> None:
        self._compiled = compiled
        self._submit = submit
        self._eos_row = eos_row  # the mask that allows only end-of-sequence
        self._report = report or _Report()
        self.matcher = compiled.matcher.deep_copy()
        self.num_accepted = 0
        self.failed = False
        self.complete = False  # matched: only end-of-sequence may follow
        # The mask of the next token; None while the mask thread computes it.
        self.mask: np.ndarray | None = compiled.initial_mask
        self.future: Future | None = None

    def accept(self, token_id: int) -> None:
        """Advances past a sampled token and starts computing the next mask."""
        if self.failed:
            return
        self.wait()  # the matcher is the mask thread's until its mask is in
        if not self.matcher.consume_token(token_id):
            self.fail("a sampled token")
            return
        self.num_accepted += 1
        if self.matcher.is_stopped():
            self.complete, self.mask = True, self._eos_row  # the stop check ends the sequence
            return
        self.mask = None
        self.future = self._submit(self)

    def poll(self) -> bool:
        """Takes the mask from the mask thread if it is done; whether the mask is in."""
        fut = self.future
        if fut is None:
            return True
        if not fut.done():
            return False
        self.future = None
        try:
            mask, failed = fut.result()
        except Exception:  # the mask thread's own failure: the constraint cannot go on
            logger.exception("pagedllm: structured output mask computation raised")
            mask, failed = None, True
        if failed:
            self.fail("the next token's mask")
        else:
            self.mask = mask
        return True

    def wait(self) -> None:
        """Blocks until the mask is in (where the engine cannot go on without it)."""
        if self.future is not None:
            concurrent.futures.wait([self.future])
            self.poll()

    def fail(self, at: str) -> None:
        """From now on only end-of-sequence; the stop check ends the sequence (``at``: what failed)."""
        self.failed = True
        self.mask = self._eos_row
        if not self._report.logged:
            self._report.logged = True
            # llguidance's stop reason is one of its fixed names (ParserTooComplex, InternalError
            # for a rejected token...); its error text is not logged: it quotes tokens and grammar.
            reason = re.sub(r"\W", "", str(self.matcher.stop_reason()))[:40]
            logger.warning(
                "pagedllm: a structured output failed at %s after %d tokens (%s); the sequence ends with "
                "stop_reason %r",
                at,
                self.num_accepted,
                reason,
                STOP_REASON,
            )

    @property
    def is_terminated(self) -> bool:
        """The output is complete: nothing but end-of-sequence may follow."""
        return self.complete and not self.failed

    @property
    def constrains(self) -> bool:
        """Its sequence's next token needs its mask (a failed one allows only end-of-sequence)."""
        return not self.is_terminated

    def fork(self, output_token_ids: list[int]) -> GrammarState:
        """The state of a sequence holding these output tokens (a fork of this one's)."""
        child = GrammarState(self._compiled, self._submit, self._eos_row, self._report)
        if not output_token_ids:  # forked at the prompt (n > 1): the compiled start, its mask ready
            return child
        if len(output_token_ids) == self.num_accepted and not self.failed:
            self.wait()
            child.matcher = self.matcher.deep_copy()
            child.num_accepted, child.mask, child.complete = self.num_accepted, self.mask, self.complete
            return child
        # Replayed here (rare); one mask, for where it ends.
        ok = child.matcher.consume_tokens(list(output_token_ids))
        child.num_accepted = len(output_token_ids)
        if not ok:
            child.fail("a replayed token")
        elif child.matcher.is_stopped():
            child.complete, child.mask = True, self._eos_row
        else:
            child.mask = None
            child.future = self._submit(child)
        return child
