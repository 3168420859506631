"""Which data-parallel replica serves a request: prefix affinity balanced by load, or round robin.

Prefix affinity (``policy="prefix"``): a replica that served a prompt holds its KV blocks in its
prefix cache for a while, so a later prompt that starts the same way prefills only its new part
there. The router cannot see the replicas' caches (they live in other processes, maybe on other
nodes, and change every step), so it keeps its own approximation, as SGLang's cache-aware router
does with its approximate radix tree: per replica, the chained hashes of the full KV blocks of the
prompts it routed there, in a bounded LRU (a replica evicts blocks too; the bound keeps the
router's memory flat and forgets what the replica has most likely evicted).

A block's hash is the engine's own (kv/block_pool.py's ``hash_full_blocks``: SHA-256 over its
tokens and the hash of the block before it), kept as its 32-byte digest, so "the first k hashes
match" means "the first k blocks of tokens are equal", and the longest match is found with one
set lookup per block. The engine also chains in a sequence's cache salt, which its model derives
from the prompt (Phi-3's LongRoPE: whether the prompt is long); the router holds no model and is
given only token ids, so it hashes without one. Prompts that differ only in salt then look alike
to it, which at worst sends a request where the replica's prefix cache misses.

The decision, per request (SGLang's thresholds, same meaning):
1. if the in-flight load is imbalanced (max - min > ``balance_abs_threshold`` and
   max > ``balance_rel_threshold`` x min), the least loaded replica: affinity must not pile a
   popular prefix onto one replica while another idles;
2. else the replica with the longest leading match, if that match covers at least
   ``cache_threshold`` of the prompt's full blocks (and at least one block);
3. else the least loaded replica (ties: the one whose record holds fewest blocks, the one with
   the most room in its cache, then the lowest index).

Only live replicas are candidates; ``route`` raises NoReplicaError when none is left. Load is the
number of requests routed to a replica and not yet released (``release``): the caller releases
each routed request exactly once, when it ends however it ends.

Pure Python and synchronous (the server calls it on its event loop, between awaits), so it is
unit-tested without Ray.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.kv.block_pool import hash_full_blocks

POLICIES = ("prefix", "round_robin")


class NoReplicaError(RuntimeError):
    """Every replica is dead: there is nowhere to send a request."""


@dataclass(frozen=True)
class RouteDecision:
    replica: int
    matched_tokens: int  # leading tokens of the prompt the chosen replica's record already held
    reason: str  # "prefix" | "least_loaded" | "imbalanced" | "round_robin"


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Digests of the chained hashes of the prompt's full blocks, as the engine hashes them
    (without a cache salt): the k-th depends on blocks 0..k.

    No hashes for a prompt whose ids are not all 64-bit integers: the router sees a prompt before
    the replica validates it, and such a prompt is routed by load alone, for the replica to refuse.
    """
    try:
        return [h.digest() for h in hash_full_blocks(token_ids, block_size)]
    except (TypeError, OverflowError):
        return []


class _BlockRecord:
    """The hashes of the blocks routed to one replica, least recently used first, at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: list[bytes]) -> int:
        """How many leading blocks are recorded."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class Router:
    """Routes requests over ``num_replicas`` replicas (see the module docstring)."""

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        policy: str = "prefix",
        max_blocks_per_replica: int = 65536,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}.")
        if block_size < 1 or max_blocks_per_replica < 1:
            raise ValueError("block_size and max_blocks_per_replica must be >= 1.")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.policy = policy
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.records = [_BlockRecord(max_blocks_per_replica) for _ in range(num_replicas)]
        self.in_flight = [0] * num_replicas
        self.alive = [True] * num_replicas
        # Cumulative, for /metrics: requests routed to each replica, prompt tokens its record matched.
        self.routed = [0] * num_replicas
        self.matched_tokens = [0] * num_replicas
        self._next = 0  # round robin's next replica

    # ---- replica state ----------------------------------------------------------------------
    def mark_dead(self, replica: int) -> None:
        """No more requests go there; its record is dropped (a restarted replica starts cold)."""
        self.alive[replica] = False
        self.records[replica] = _BlockRecord(self.records[replica].capacity)

    def live_replicas(self) -> list[int]:
        return [i for i in range(self.num_replicas) if self.alive[i]]

    def release(self, replica: int) -> None:
        """A request routed to ``replica`` ended (finished, aborted or failed)."""
        if self.in_flight[replica] <= 0:
            raise RuntimeError(f"replica {replica} released more requests than were routed to it.")
        self.in_flight[replica] -= 1

    # ---- routing ----------------------------------------------------------------------------
    def route(self, token_ids: Sequence[int]) -> RouteDecision:
        """Picks a live replica for a prompt and counts the request as in flight there."""
        live = self.live_replicas()
        if not live:
            raise NoReplicaError("Every data-parallel replica is dead.")
        hashes = block_hashes(token_ids, self.block_size) if self.policy == "prefix" else []
        # Each live record's leading match, computed once: the choice and the counters read it.
        matches = {i: self.records[i].match(hashes) for i in live} if hashes else dict.fromkeys(live, 0)
        if self.policy == "round_robin":
            decision = self._round_robin()
        else:
            decision = self._prefix(live, matches, len(hashes))
        r = decision.replica
        matched = matches[r] * self.block_size  # under the threshold too
        self.records[r].add(hashes)
        self.in_flight[r] += 1
        self.routed[r] += 1
        self.matched_tokens[r] += matched
        return RouteDecision(r, matched, decision.reason)

    def _round_robin(self) -> RouteDecision:
        for k in range(self.num_replicas):
            r = (self._next + k) % self.num_replicas
            if self.alive[r]:
                self._next = (r + 1) % self.num_replicas
                return RouteDecision(r, 0, "round_robin")
        raise AssertionError("unreachable: live is not empty")  # pragma: no cover

    def _least_loaded(self, live: list[int]) -> int:
        return min(live, key=lambda i: (self.in_flight[i], len(self.records[i]), i))

    def _imbalanced(self, live: list[int]) -> bool:
        loads = [self.in_flight[i] for i in live]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def _prefix(self, live: list[int], matches: dict[int, int], num_blocks: int) -> RouteDecision:
        if len(live) > 1 and self._imbalanced(live):
            return RouteDecision(self._least_loaded(live), 0, "imbalanced")
        if num_blocks:
            # Longest match; among equal matches the least loaded.
            best = max(live, key=lambda i: (matches[i], -self.in_flight[i], -i))
            blocks = matches[best]
            if blocks >= 1 and blocks >= self.cache_threshold * num_blocks:
                return RouteDecision(best, blocks * self.block_size, "prefix")
        return RouteDecision(self._least_loaded(live), 0, "least_loaded")
