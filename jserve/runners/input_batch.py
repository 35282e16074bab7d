"""The sequences a real runner keeps between steps, one slot each: block tables and
sampling settings in numpy arrays changed only by each batch's `BatchDelta`, so a step's
inputs are a few row gathers rather than a rebuild from Python objects (vLLM v1's
persistent `InputBatch` and `BlockTable` do the same)."""

from __future__ import annotations

import numpy as np

from jserve.engine.batch import BatchDelta

# Slots the arrays start with; they double when more sequences are held at once.
INITIAL_SLOTS = 64
# A token row index past any slot: the device counts skip it (`TokenCounts.counted`).
NO_ROW = np.iinfo(np.int32).max
# Per-slot columns and what an empty slot holds.
_COLUMNS = (("num_blocks", np.int32, 0), ("temperature", np.float32, 0), ("top_p", np.float32, 1),
            ("top_k", np.int32, 0), ("seeds", np.uint32, 0), ("presence", np.float32, 0),
            ("frequency", np.float32, 0), ("repetition", np.float32, 1), ("prompt_len", np.int32, 0),
            ("counted", np.int32, 0), ("min_tokens", np.int32, 0), ("biased", bool, False))


class PersistentBatch:
    def __init__(self, max_blocks: int, scratch_block: int, slots: int = INITIAL_SLOTS) -> None:
        """Tables up to `max_blocks` wide; unused entries point at `scratch_block`."""
        self.scratch_block = scratch_block
        self.tables = np.full((slots, max_blocks), scratch_block, np.int32)
        # Penalties, where a sequence's output tokens start, and the positions whose tokens
        # the device counts hold (a recompute after preemption feeds them again); the
        # minimum length, and whether the device's bias row of the slot is its own.
        for name, dtype, fill in _COLUMNS:
            setattr(self, name, np.full(slots, fill, dtype))
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
            pen = added.penalties
            self.presence[slots] = 0 if pen is None else pen.presence
            self.frequency[slots] = 0 if pen is None else pen.frequency
            self.repetition[slots] = 1 if pen is None else pen.repetition
            self.prompt_len[slots] = 0 if pen is None else pen.prompt_len
            self.counted[slots] = 0
            rules = added.rules
            self.min_tokens[slots] = 0 if rules is None else rules.min_tokens
            self.biased[slots] = False if rules is None else rules.biased
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

    @property
    def capacity(self) -> int:
        return len(self.num_blocks)

    def penalised(self, slots: np.ndarray) -> np.ndarray:
        return (self.presence[slots] != 0) | (self.frequency[slots] != 0) | (self.repetition[slots] != 1)

    def count_rows(self, slots: np.ndarray, start: np.ndarray, query_lens: np.ndarray) -> np.ndarray:
        """Per token of a step computing `query_lens` tokens from `start` for the sequences
        in `slots`: the slot whose output-token counts it adds to, `NO_ROW` for a prompt
        token, a position counted before (recomputed), or a sequence without penalties.
        Marks the positions counted."""
        rows = np.full(int(query_lens.sum()), NO_ROW, np.int32)
        pen = self.penalised(slots)
        if not pen.any():
            return rows
        at = np.repeat(np.arange(len(slots)), query_lens)
        pos = np.arange(len(at)) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens) + start[at]
        s = slots[at]
        new = pen[at] & (pos >= np.maximum(self.counted[s], self.prompt_len[s]))
        rows[new] = s[new]
        self.counted[slots] = np.maximum(self.counted[slots], np.where(pen, start + query_lens, 0))
        return rows

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
        for name, _, fill in _COLUMNS:
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.full_like(a, fill)]))
        self._free.extend(range(2 * n - 1, n - 1, -1))
