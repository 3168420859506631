"""GrammarState: one sequence's matcher, and the mask of its next token, computed ahead.

When a sequence accepts a token, the mask of its next one is computed at once in a mask thread
(masks.py), while the engine finishes the step and schedules the next; a sequence is scheduled
to sample only once its mask is in (Sequence.waits_for_mask), so one expensive constraint slows
its own sequences, never a step everyone waits for.

A matcher that fails (a sampled token it rejects, or a parser limit such as llguidance's items
per row) never stops constraining silently: from then on only end-of-sequence is allowed and
the sequence ends with stop_reason STOP_REASON. One warning is logged per request, without the
grammar or the error's text (both are the client's content).

Speculative decoding (spec_decode/planner.py) walks a sequence's drafts through the matcher
without committing (``propose``): it keeps the leading drafts the grammar allows and the mask of
each position after them, then rolls the matcher back. The verifying pass masks each position
with its own mask (``position_masks``), and as the kept tokens are appended the matcher advances
over exactly them; a kept token that is the planned draft takes the mask computed for it, so only
the token after the run (the bonus or corrected one) has its mask computed ahead as usual.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from pagedllm.structured_output.grammar import CompiledGrammar, compute_mask

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
        # Every token accepted: a matcher a failed speculative walk left in error is rebuilt from them.
        self._tokens: list[int] = []
        # The drafts ``propose`` kept from the matcher's current state and the mask after each one
        # (masks[i]: after drafts[:i + 1]); ``_next``: how many of them accept() has taken since.
        self._drafts: list[int] = []
        self._draft_masks: list[np.ndarray] = []
        self._next = 0

    def accept(self, token_id: int) -> None:
        """Advances past a sampled token and starts computing the next mask."""
        if self.failed:
            return
        self.wait()  # the matcher is the mask thread's until its mask is in
        planned = self._next < len(self._drafts) and self._drafts[self._next] == token_id
        if not planned:  # off the planned drafts: their masks are not this state's
            self._drafts, self._draft_masks, self._next = [], [], 0
        if not self.matcher.consume_token(token_id):
            self.fail("a sampled token")
            return
        self.num_accepted += 1
        self._tokens.append(token_id)
        if self.matcher.is_stopped():
            self.complete, self.mask = True, self._eos_row  # the stop check ends the sequence
            return
        if planned:  # its mask was computed when the draft was proposed, for this very state
            self.mask = self._draft_masks[self._next]
            self._next += 1
            return
        self.mask = None
        self.future = self._submit(self)

    def propose(self, drafts: list[int]) -> list[int]:
        """The leading ``drafts`` the grammar allows after this sequence's tokens: a draft it
        forbids could never be accepted, nor any after it. Walks them through the matcher without
        committing, computing the mask of the position after each (kept for ``position_masks``
        and for accept() of the same tokens). A draft that completes the grammar is the last one
        (the sequence stops at it); a draft after which the mask cannot be computed is left out
        (the sequence meets that failure as it would without speculation: when it takes the
        token). Runs on the engine thread, once the mask of the next token is in."""
        self.wait()  # the matcher is the mask thread's until its mask is in
        self._drafts, self._draft_masks, self._next = [], [], 0
        if self.failed or self.complete or not drafts:
            return []
        matcher = self.matcher
        drafts = drafts[: matcher.validate_tokens(drafts)]
        masks: list[np.ndarray] = []
        consumed = 0
        for token_id in drafts:
            if not matcher.consume_token(token_id):
                break
            consumed += 1
            if matcher.is_stopped():
                masks.append(self._eos_row)  # complete: only end-of-sequence may follow
                break
            mask = compute_mask(matcher, self._eos_row.size)
            if matcher.is_error():
                break
            masks.append(mask)
        if consumed and (matcher.is_error() or not matcher.rollback(consumed)):
            self._rebuild()  # an error is for good in llguidance: no rolling back out of it
            if self.failed:
                return []
        self._drafts, self._draft_masks = drafts[: len(masks)], masks
        return list(self._drafts)

    def position_masks(self, num_drafts: int) -> list[np.ndarray]:
        """The masks of a verifying pass over the last token and the first ``num_drafts`` drafts
        ``propose`` kept: row i allows what the grammar allows after drafts[:i]."""
        assert self._next == 0 and num_drafts <= len(self._draft_masks), "drafts not proposed from this state"
        if self.mask is None:
            self.wait()
        return [self.mask, *self._draft_masks[:num_drafts]]

    def _rebuild(self) -> None:
        """A fresh matcher over the tokens accepted so far (rare: a speculative walk failed)."""
        matcher = self._compiled.matcher.deep_copy()
        if self._tokens and not matcher.consume_tokens(self._tokens):
            self.matcher = matcher
            self.fail("a replayed token")
            return
        self.matcher = matcher

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
            child._tokens = list(self._tokens)
            child.num_accepted, child.mask, child.complete = self.num_accepted, self.mask, self.complete
            return child
        # Replayed here (rare); one mask, for where it ends.
        ok = child.matcher.consume_tokens(list(output_token_ids))
        child.num_accepted = len(output_token_ids)
        child._tokens = list(output_token_ids)
        if not ok:
            child.fail("a replayed token")
        elif child.matcher.is_stopped():
            child.complete, child.mask = True, self._eos_row
        else:
            child.mask = None
            child.future = self._submit(child)
        return child
