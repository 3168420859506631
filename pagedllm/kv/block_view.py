"""A snapshot of the KV cache block by block, for the live view (the server's /kv page).

Each physical block gets one state code, sent as base64 bytes (one byte a block: 100k blocks are
133 kB of JSON), not one object per block. The managers build the state array with numpy over
their own arrays (BlockPool.ref_counts) or per reservation, never with a Python loop over
blocks, so a snapshot of a 100k-block cache stays cheap enough to take between engine steps.

Per sequence the snapshot has its block table (logical index -> physical block) and its tokens
held vs slots reserved: the page derives who shares which block from the tables.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# One byte per block. The page (entrypoints/openai/kv_view.html) has the same table.
FREE = 0  # no holder, no cached prefix
CACHED = 1  # no holder, but its K/V is a prefix-cache entry a later request can reuse
USED = 2  # held by one sequence
SHARED = 3  # held by several (forks, beams, prefix-cache hits): refcounts in BlockSnapshot.shared_refs
SWAPPING = 4  # moved to or from host memory by the last step
RESERVED = 5  # contiguous layouts: reserved by a request, holding none of its tokens yet
STATE_NAMES = ("free", "cached", "used", "shared", "swapping", "reserved")


@dataclass
class SeqBlocks:
    """One sequence's part of the cache: its block table, tokens held, slots reserved."""

    seq_id: str
    blocks: list[int]
    num_tokens: int
    reserved_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_id": self.seq_id,
            "blocks": self.blocks,
            "num_tokens": self.num_tokens,
            "reserved_tokens": self.reserved_tokens,
        }


@dataclass
class BlockSnapshot:
    """Every block's state (uint8 codes above), the shared blocks' refcounts, the sequences."""

    layout: str
    block_size: int
    states: np.ndarray
    seqs: list[SeqBlocks]
    shared_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    shared_refs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    num_host_blocks: int = 0
    num_host_blocks_used: int = 0

    def state_counts(self) -> dict[str, int]:
        counts = np.bincount(self.states, minlength=len(STATE_NAMES))
        return {name: int(counts[i]) for i, name in enumerate(STATE_NAMES)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "num_blocks": int(self.states.size),
            "block_size": self.block_size,
            "state_names": list(STATE_NAMES),
            "states": base64.b64encode(self.states.tobytes()).decode("ascii"),
            "state_counts": self.state_counts(),
            "shared": {"blocks": self.shared_blocks.tolist(), "refs": self.shared_refs.tolist()},
            "seqs": [s.to_dict() for s in self.seqs],
            "host": {"num_blocks": self.num_host_blocks, "num_used": self.num_host_blocks_used},
        }


def decode_states(encoded: str) -> np.ndarray:
    """The inverse of the "states" field of BlockSnapshot.to_dict (for clients and tests)."""
    return np.frombuffer(base64.b64decode(encoded), dtype=np.uint8)
