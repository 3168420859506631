"""The interface every KV cache manager implements, and the memory accounting they report."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal, NamedTuple

from pagedllm.kv.block_view import BlockSnapshot
from pagedllm.sequence import Sequence

# Block-table entry of a block released because it fell out of every layer's sliding window: no
# attention path reads it (they start at the window), and no token is ever written to it.
NULL_BLOCK = -1


class BlockOp(NamedTuple):
    """Physical block moves the runner performs before a step's forward, in recorded order.

    kind "copy": device block -> device block (copy-on-write of a shared, partly filled block);
    "swap_out": device -> host block; "swap_in": host -> device block. Every layer's K and V move.
    Order matters (a block freed by a swap-out may be the destination of a later copy), so the
    manager records them as they happen and the runner replays them in that order.
    """

    kind: Literal["copy", "swap_out", "swap_in"]
    pairs: list[tuple[int, int]]  # (src block, dst block)


@dataclass
class KVCacheStats:
    """A snapshot of KV memory, in token slots.

    used: slots holding a real token's K/V (shared slots counted once);
    reserved: slots set aside for running sequences (used + allocated-but-not-yet-used);
    free: slots not reserved; unusable_free: free slots no waiting sequence could be given
    (external fragmentation: only the contiguous layouts have it).
    """

    total: int
    reserved: int
    used: int
    free: int
    unusable_free: int = 0
    shared_blocks: int = 0
    # Blocks the block tables reference, a shared block once per sequence holding it: what the
    # same sequences would take without sharing (paper: memory saved = 1 - reserved blocks / this).
    logical_blocks: int = 0

    @property
    def waste(self) -> float:
        """Fraction of reserved slots that hold no token (internal fragmentation + reservation)."""
        return 0.0 if self.reserved == 0 else 1.0 - self.used / self.reserved

    @property
    def utilization(self) -> float:
        return self.used / self.total if self.total else 0.0


class KVCacheManager(abc.ABC):
    """Maps each request's tokens to physical KV slots.

    The scheduler calls ``allocate_slots`` before a sequence runs ``num_new_tokens`` more tokens,
    and ``free`` when it finishes or is preempted. Only the scheduler reads ``block_table``: it
    sends each table to the runner in its SchedulerOutputs (whole, then what changed:
    scheduler_sync.py), and the runner keeps its own copy (runner/block_table.py), never asking a
    manager. Token position p of a sequence lives in slot ``block_table[p // block_size] *
    block_size + p % block_size`` of the physical cache.
    """

    block_size: int
    num_blocks: int

    @abc.abstractmethod
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks already holding this request's leading full blocks (prefix cache hits)."""

    @abc.abstractmethod
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Makes room for ``num_new_tokens`` more tokens; False (and no change) if it cannot."""

    @abc.abstractmethod
    def free(self, seq: Sequence) -> None:
        """Releases everything the request holds."""

    @abc.abstractmethod
    def block_table(self, request_id: str) -> list[int]: ...

    @abc.abstractmethod
    def num_free_blocks(self) -> int: ...

    @abc.abstractmethod
    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request needing ``num_tokens`` slots fits in an otherwise empty cache."""

    @abc.abstractmethod
    def stats(self) -> KVCacheStats: ...

    def release_out_of_window(self, seq: Sequence) -> int:
        """After a step: frees the sequence's blocks no query of it can see any more (all layers
        windowed); returns how many. Managers that keep every block return 0."""
        return 0

    def trim_to_computed(self, seq: Sequence) -> int:
        """Gives back the sequence's blocks past its ``num_computed_tokens`` (lookahead slots of
        rejected drafts); returns the table's length after. Only managers that take speculative
        decoding (EngineConfig refuses it for the others) implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not support speculative decoding")

    @abc.abstractmethod
    def block_snapshot(self) -> BlockSnapshot:
        """Every physical block's state and every sequence's block table (kv/block_view.py).

        Cheap at any cache size (numpy over blocks, Python only per sequence): the server's
        /kv/blocks takes one between engine steps at up to a few Hz."""

    def cache_computed_blocks(self, seq: Sequence) -> None:  # noqa: B027 (optional: no prefix cache)
        """Registers the sequence's full, written blocks in the prefix cache (if it has one)."""

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_blocks

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(queries, hits) in blocks; zeros for managers without a prefix cache."""
        return 0, 0

    # ---- sharing and swapping (optional: managers without them keep these defaults) --------
    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Makes ``child`` share ``parent``'s blocks for the tokens it holds (refcounts, no copy).

        False means this manager cannot share, or the parent holds no blocks: the child then
        starts with none and recomputes its tokens.
        """
        return False

    def take_block_ops(self) -> list[BlockOp]:
        """The block copies / swaps recorded since the last call (the scheduler passes them on)."""
        return []

    def enable_swap(self, num_host_blocks: int) -> None:
        """Adds a host-memory pool of ``num_host_blocks`` blocks for preemption by swapping."""
        raise NotImplementedError(f"{type(self).__name__} does not support swapping")

    @property
    def can_swap(self) -> bool:
        return False

    def swap_out(self, seqs: list[Sequence]) -> bool:
        """Moves the requests' blocks to host memory (a block they share is copied once)."""
        raise NotImplementedError(f"{type(self).__name__} does not support swapping")

    def swap_in(self, seqs: list[Sequence], reserve: int = 0) -> bool:
        """Moves the requests' blocks back, if that leaves ``reserve`` device blocks free."""
        raise NotImplementedError(f"{type(self).__name__} does not support swapping")
