"""The sequences a real runner keeps between steps, one slot each: block tables and
sampling settings in numpy arrays changed only by each batch's `BatchDelta`, so a step's
inputs are a few row gathers rather than a rebuild from Python objects (vLLM v1's
persistent `InputBatch` and `BlockTable` do the same)."""

from __future__ import annotations

import numpy as np

from jserve.engine.batch import BatchDelta

# Slots the arrays start with; they double when more sequences are held at once.
INITIAL_SLOTS = 64


class PersistentBatch:
    def __init__(self, max_blocks: int, scratch_block: int, slots: int = INITIAL_SLOTS) -> None:
        """Tables up to `max_blocks` wide; unused entries point at `scratch_block`."""
        self.scratch_block = scratch_block
        self.tables = np.full((slots, max_blocks), scratch_block, np.int32)
        self.num_blocks = np.zeros(slots, np.int32)
        self.temperature = np.zeros(slots, np.float32)
        self.top_p = np.ones(slots, np.float32)
        self.top_k = np.zeros(slots, np.int32)
        self.seeds = np.zeros(slots, np.uint32)
        self._slot: dict[int, int] = {}
        self._free: list[int] = list(range(slots - 1, -1, -1))

    @classmethod
    def holding(cls, delta: BatchDelta, max_blocks: int, scratch_block: int) -> PersistentBatch:
        """A persistent batch of one hand-made batch's sequences (`BatchDelta.of_sequences`)."""
        held = cls(max_blocks, scratch_block)
        held.apply(delta)
        return held

    @property
    def num_held(self) -> int:
        return len(self._slot)

    def apply(self, delta: BatchDelta) -> None:
        """New sequences take slots, tables change in place, ended sequences free theirs."""
        added = delta.added
        if len(added.seq_ids):
            slots = self.slots(added.seq_ids.tolist())
            self.temperature[slots] = added.temperature
            self.top_p[slots] = added.top_p
            self.top_k[slots] = added.top_k
            self.seeds[slots] = added.seeds
        for seq_id, (at, blocks) in delta.tables.items():
            slot = self._slot_of(seq_id)
            end = at + len(blocks)
            self.tables[slot, at:end] = blocks
            self.tables[slot, end:self.num_blocks[slot]] = self.scratch_block
            self.num_blocks[slot] = end
        for seq_id in delta.ended:  # last: an ended sequence's freed table is in `tables`
            slot = self._slot.pop(seq_id, None)
            if slot is not None:
                self._free.append(slot)

    def slots(self, seq_ids: list[int]) -> np.ndarray:
        """The slots of `seq_ids` (a sequence without one takes one)."""
        return np.fromiter(map(self._slot_of, seq_ids), np.int64, len(seq_ids))

    def table(self, slot: int) -> np.ndarray:
        return self.tables[slot, : self.num_blocks[slot]]

    def _slot_of(self, seq_id: int) -> int:
        slot = self._slot.get(seq_id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._slot[seq_id] = self._free.pop()
            self.tables[slot] = self.scratch_block
            self.num_blocks[slot] = 0
        return slot

    def _grow(self) -> None:
        n = len(self.num_blocks)
        self.tables = np.concatenate([self.tables, np.full_like(self.tables, self.scratch_block)])
        for name, fill in (("num_blocks", 0), ("temperature", 0), ("top_p", 1), ("top_k", 0), ("seeds", 0)):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.full_like(a, fill)]))
        self._free.extend(range(2 * n - 1, n - 1, -1))
