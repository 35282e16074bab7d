"""Paged KV block bookkeeping: free list, reference counts, per-sequence block tables.

Plain Python/numpy owned by one object; `check_invariants` states what must always hold
and the property tests call it after every engine step.

With a prefix cache, a block is in exactly one of three states: free (on the free list),
used (referenced by at least one table), or evictable (cached, referenced by none; it
returns to the free list only when an eviction rule picks it).
"""

from __future__ import annotations

import numpy as np

from jserve.cache.prefix import PrefixIndex
from jserve.errors import PlanError


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix: PrefixIndex | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix = prefix
        # LIFO free list: recently freed blocks are reused first (warm in caches).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self._tables: dict[int, list[int]] = {}
        self.num_evictable = 0
        self.num_table_blocks = 0  # sum of table lengths: a shared block counts per holder
        # Whole blocks lent to a `LayerSlab` (split into per-layer slots); neither free nor in
        # any table while lent.
        self.lent = np.zeros(num_blocks, dtype=bool)
        self.num_lent = 0
        # Tables changed since the last `take_changes`: seq id -> first changed index. A
        # runner that keeps tables between steps is sent these changes, not whole tables.
        self._changed: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks on the free list (evictable cached blocks not included)."""
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_held(self, seq_id: int) -> int:
        return len(self._tables.get(seq_id, ()))

    def seq_ids(self) -> set[int]:
        return set(self._tables)

    def allocate(self, seq_id: int, n: int) -> None:
        """Append `n` fresh blocks to the sequence's table."""
        if n < 0:
            raise PlanError(f"seq {seq_id}: cannot allocate {n} blocks")
        if n > len(self._free):
            raise PlanError(f"seq {seq_id}: asked for {n} blocks, only {len(self._free)} free")
        if n == 0:
            return
        table = self._tables.setdefault(seq_id, [])
        self._touch(seq_id, len(table))
        for _ in range(n):
            block = self._free.pop()
            self.ref_counts[block] += 1
            table.append(block)
        self.num_table_blocks += n

    def lend(self) -> int:
        """Take a whole free block out of the free list for a `LayerSlab` to split."""
        if not self._free:
            raise PlanError("no free block to split into layer slots")
        block = self._free.pop()
        self.lent[block] = True
        self.num_lent += 1
        return block

    def take_back(self, block: int) -> None:
        """A lent block whose every layer slot is free again: back on the free list."""
        self.lent[block] = False
        self.num_lent -= 1
        self._free.append(block)

    def lend_table(self, seq_id: int) -> list[int]:
        """Hand a sequence's whole table to a `LayerSlab` (its blocks keep their contents and
        become split blocks it holds every slot of); the sequence holds no table after."""
        table = self._tables.pop(seq_id, [])
        self._touch(seq_id, 0)
        if (self.ref_counts[table] != 1).any():
            raise PlanError(f"seq {seq_id}: a shared block cannot be split into layer slots")
        self.ref_counts[table] = 0
        self.lent[table] = True
        self.num_lent += len(table)
        self.num_table_blocks -= len(table)
        return table

    def attach(self, seq_id: int, blocks: list[int]) -> None:
        """Start an empty table with cached blocks (a prefix-cache hit), sharing them."""
        if self.num_held(seq_id):
            raise PlanError(f"seq {seq_id}: cached blocks can only start a table")
        for block in blocks:
            if self.prefix is None or not self.prefix.cached[block]:
                raise PlanError(f"seq {seq_id}: block {block} is not cached")
            if self.ref_counts[block] == 0:
                self.num_evictable -= 1
            self.ref_counts[block] += 1
        if blocks:
            self._touch(seq_id, 0)
            self._tables[seq_id] = list(blocks)
            self.num_table_blocks += len(blocks)

    def free(self, seq_id: int) -> int:
        """Release every block the sequence holds; returns how many were held. Cached
        blocks nobody references any more stay cached, evictable."""
        table = self._tables.pop(seq_id, [])
        if table:
            self._touch(seq_id, 0)
        cached = self.prefix.cached if self.prefix is not None else None
        for block in reversed(table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if cached is not None and cached[block]:
                    self.num_evictable += 1
                else:
                    self._free.append(block)
        self.num_table_blocks -= len(table)
        return len(table)

    def _touch(self, seq_id: int, at: int) -> None:
        self._changed[seq_id] = min(at, self._changed.get(seq_id, at))

    def take_changes(self) -> dict[int, tuple[int, np.ndarray]]:
        """Each table changed since the last call: seq id -> (first changed index, the
        table from that index on; empty for a freed table)."""
        changed, self._changed = self._changed, {}
        return {s: (at, np.asarray(self._tables.get(s, ())[at:], np.int32)) for s, at in changed.items()}

    def discard_changes(self) -> None:
        """Forget the changes (no runner keeps tables: the simulator)."""
        self._changed.clear()

    def released_by(self, seq_ids: list[int]) -> np.ndarray:
        """Blocks no one would reference once these sequences free their tables."""
        tables = [self._tables[s] for s in seq_ids if s in self._tables]
        if not tables:
            return np.zeros(0, np.int64)
        held = np.concatenate([np.asarray(t, np.int64) for t in tables])
        drop = np.zeros(self.num_blocks, np.int32)
        np.add.at(drop, held, 1)
        return np.flatnonzero((drop > 0) & (drop == self.ref_counts))

    def evictable(self) -> np.ndarray:
        if self.prefix is None:
            return np.zeros(0, np.int64)
        return np.flatnonzero(self.prefix.cached & (self.ref_counts == 0))

    def evict(self, blocks: list[int]) -> None:
        """Drop cached, unreferenced blocks from the prefix cache onto the free list."""
        for block in blocks:
            if self.prefix is None or not self.prefix.cached[block] or self.ref_counts[block]:
                raise PlanError(f"block {block} is not an evictable cached block")
            self.prefix.remove(block)
            self.num_evictable -= 1
            self._free.append(block)

    def check_invariants(self) -> None:
        free = np.zeros(self.num_blocks, dtype=bool)
        free[self._free] = True
        counts = np.zeros(self.num_blocks, dtype=np.int32)
        for table in self._tables.values():
            np.add.at(counts, table, 1)
        assert len(set(self._free)) == len(self._free), "a block is on the free list twice"
        assert (self.ref_counts >= 0).all(), "negative reference count"
        assert np.array_equal(counts, self.ref_counts), "reference counts disagree with tables"
        assert not (free & (counts > 0)).any(), "a block is both free and used"
        assert not (self.lent & (free | (counts > 0))).any(), "a lent block is free or in a table"
        assert int(self.lent.sum()) == self.num_lent
        assert int(counts.sum()) == self.num_table_blocks
        cached = self.prefix.cached if self.prefix is not None else np.zeros_like(free)
        assert not (free & cached).any(), "a block is both free and cached"
        evictable = int((cached & (counts == 0)).sum())
        assert evictable == self.num_evictable, "evictable count is off"
        total = int(free.sum() + (counts > 0).sum()) + evictable + self.num_lent
        assert total == self.num_blocks, "used + free + evictable + lent != total"
        if self.prefix is not None:
            self.prefix.check_invariants()
