"""The interface every KV cache manager implements, and the memory accounting they report."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from pagedllm.request import Request


@dataclass
class KVCacheStats:
    """A snapshot of KV memory, in token slots.

    used: slots holding a real token's K/V (shared slots counted once);
    reserved: slots set aside for running requests (used + allocated-but-not-yet-used);
    free: slots not reserved; unusable_free: free slots no waiting request could be given
    (external fragmentation: only the contiguous layouts have it).
    """

    total: int
    reserved: int
    used: int
    free: int
    unusable_free: int = 0
    shared_blocks: int = 0

    @property
    def waste(self) -> float:
        """Fraction of reserved slots that hold no token (internal fragmentation + reservation)."""
        return 0.0 if self.reserved == 0 else 1.0 - self.used / self.reserved

    @property
    def utilization(self) -> float:
        return self.used / self.total if self.total else 0.0


class KVCacheManager(abc.ABC):
    """Maps each request's tokens to physical KV slots.

    The scheduler calls ``allocate_slots`` before a request runs ``num_new_tokens`` more tokens,
    and ``free`` when it finishes or is preempted. The runner reads ``block_table``:
    token position p of a request lives in slot ``block_table[p // block_size] * block_size +
    p % block_size`` of the physical cache.
    """

    block_size: int
    num_blocks: int

    @abc.abstractmethod
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding this request's leading full blocks (prefix cache hits)."""

    @abc.abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Makes room for ``num_new_tokens`` more tokens; False (and no change) if it cannot."""

    @abc.abstractmethod
    def free(self, request: Request) -> None:
        """Releases everything the request holds."""

    @abc.abstractmethod
    def block_table(self, request_id: str) -> list[int]:
        ...

    @abc.abstractmethod
    def num_free_blocks(self) -> int:
        ...

    @abc.abstractmethod
    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request needing ``num_tokens`` slots fits in an otherwise empty cache."""

    @abc.abstractmethod
    def stats(self) -> KVCacheStats:
        ...

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_blocks

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(queries, hits) in blocks; zeros for managers without a prefix cache."""
        return 0, 0
