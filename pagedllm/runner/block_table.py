"""The runner's own block tables: one row per sequence it holds, kept up to date from each
SchedulerOutput (appended blocks, blocks replaced by copy-on-write), never asked of a KV manager.

Rows live in one [capacity, max_blocks] tensor, zero past each table's end, so a step's decode
block tables are one row gather, and a prefill's table is a row slice.
"""

from __future__ import annotations

import torch


class BlockTables:
    def __init__(self, max_blocks_per_seq: int, capacity: int = 64) -> None:
        self.max_blocks = max_blocks_per_seq
        self.table = torch.zeros(capacity, max_blocks_per_seq, dtype=torch.long)
        self.num_blocks: list[int] = [0] * capacity
        self._row: dict[str, int] = {}
        self._free_rows: list[int] = list(range(capacity - 1, -1, -1))

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._row

    def row(self, seq_id: str) -> int:
        return self._row[seq_id]

    def set(self, seq_id: str, block_ids: list[int]) -> None:
        """Gives the sequence exactly this table (a new sequence, or one whose blocks moved)."""
        if len(block_ids) > self.max_blocks:
            raise ValueError(f"block table of {len(block_ids)} blocks exceeds {self.max_blocks}")
        r = self._row.get(seq_id)
        if r is None:
            if not self._free_rows:
                self._grow()
            r = self._free_rows.pop()
            self._row[seq_id] = r
        self.table[r].zero_()
        if block_ids:
            self.table[r, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.long)
        self.num_blocks[r] = len(block_ids)

    def update(self, seq_id: str, new_block_ids: list[int], replaced: list[tuple[int, int]]) -> None:
        r = self._row[seq_id]
        row = self.table[r]
        for j, b in replaced:
            row[j] = b
        n = self.num_blocks[r]
        if new_block_ids:
            if n + len(new_block_ids) > self.max_blocks:
                raise ValueError(f"block table of {n + len(new_block_ids)} blocks exceeds {self.max_blocks}")
            row[n : n + len(new_block_ids)] = torch.tensor(new_block_ids, dtype=torch.long)
            self.num_blocks[r] = n + len(new_block_ids)

    def truncate(self, seq_id: str, num_blocks: int) -> None:
        """Cuts the sequence's table to its first ``num_blocks`` blocks (the rest were given back)."""
        r = self._row[seq_id]
        if num_blocks < self.num_blocks[r]:
            self.table[r, num_blocks:] = 0
            self.num_blocks[r] = num_blocks

    def remove(self, seq_id: str) -> None:
        r = self._row.pop(seq_id, None)
        if r is not None:
            self.table[r].zero_()
            self.num_blocks[r] = 0
            self._free_rows.append(r)

    def block_ids(self, seq_id: str) -> list[int]:
        r = self._row[seq_id]
        return self.table[r, : self.num_blocks[r]].tolist()

    def _grow(self) -> None:
        old = self.table.shape[0]
        self.table = torch.cat([self.table, torch.zeros_like(self.table)])
        self.num_blocks.extend([0] * old)
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
