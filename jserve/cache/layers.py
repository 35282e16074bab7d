"""Layer-wise KV residency (LayerKV): which layers a partly offloaded request keeps on the
device, and the per-layer slots its blocks live in.

A block is normally an all-layer unit: block `b` is row `b` of every layer's pool, and a
fully resident request holds whole blocks in one table shared by every layer (the
`BlockManager`'s, untouched by anything here, so existing policies and their speed are as
before). A request that keeps only some layers on the device instead holds *layer slots*:
slot `(b, l)` is row `b` of layer `l`'s pool. Slots come from whole blocks a `LayerSlab`
borrows from the `BlockManager` and splits; requests with different kept layers share a
split block, and it goes back to the whole-block free list when all its slots are free
again. So the device memory a request frees by offloading layers is usable by others at
once, as slots of other partial requests or, once a block's slots are all free, as a whole
block. The host tier is split the same way for offloaded layers' KV.

Counting: with `W` whole free blocks and `f[l]` free slots of layer `l` in split blocks,
layer `l` can still give out `f[l] + W` slots, and splitting or merging a block leaves that
number unchanged. So a set of slot requests fits exactly when, for every layer, the slots
asked of it are at most `f[l] + W` (what `layer_shortfall` computes), provided whole-block
takes come first (the engine applies them first).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.errors import PlanError


def kept_layers(num_layers: int, x: int) -> tuple[int, ...]:
    """The `x` of `num_layers` layers whose KV stays on the device, evenly spread and ending
    at the last layer: the `j`-th kept layer is `(j + 1) * L // x - 1`, which for LayerKV's
    8-layer example with 4 kept gives layers 1, 3, 5, 7 (Section 3.1.2: even layers offloaded, so layer 0's copy to the host runs
    while layers 0 and 1 compute). The last layer is kept first because nothing computes
    after it to hide its copy."""
    if not 0 <= x <= num_layers:
        raise ValueError(f"cannot keep {x} of {num_layers} layers")
    return tuple((j + 1) * num_layers // x - 1 for j in range(x))


def layer_demand(num_layers: int, x: int, n: int) -> np.ndarray:
    """Device slots per layer that `n` logical blocks of a request keeping `x` layers take."""
    demand = np.zeros(num_layers, np.int64)
    demand[list(kept_layers(num_layers, x))] = n
    return demand


def layer_shortfall(demand: np.ndarray, free_slots: np.ndarray, whole_free: int) -> int:
    """How many slots the layer most short of them lacks (0: `demand[l]` slots of every layer
    `l` can be given out of `free_slots[l]` split-block slots and `whole_free` whole blocks)."""
    return int(max(0, (np.asarray(demand) - np.asarray(free_slots) - whole_free).max(initial=0)))


class LayerSlab:
    """Whole blocks of a `BlockManager` split into per-layer slots.

    Each layer has a LIFO list of split blocks whose slot in that layer is free; entries go
    stale when a block merges back (or its slot is taken through another entry), and are
    skipped when popped, so no merge walks every layer's list."""

    def __init__(self, blocks: BlockManager, num_layers: int) -> None:
        self.blocks = blocks
        self.num_layers = num_layers
        self.used = np.zeros((blocks.num_blocks, num_layers), bool)
        self.split = np.zeros(blocks.num_blocks, bool)
        self.free_slots = np.zeros(num_layers, np.int64)  # free slots of split blocks, per layer
        self._free: list[list[int]] = [[] for _ in range(num_layers)]

    @property
    def num_split(self) -> int:
        return self.blocks.num_lent

    def take(self, layer: int, n: int) -> list[int]:
        """`n` slots of `layer` (block ids in that layer's pool), splitting whole blocks when
        the layer's split slots run out."""
        free, out = self._free[layer], []
        while len(out) < n:
            if not free:
                self._split(self.blocks.lend())
            b = free.pop()
            if self.split[b] and not self.used[b, layer]:
                self.used[b, layer] = True
                self.free_slots[layer] -= 1
                out.append(b)
        return out

    def adopt(self, blocks: list[int]) -> None:
        """Whole blocks a request held (`BlockManager.lend_table`), now split blocks whose
        every slot it still holds."""
        self.split[blocks] = True
        self.used[blocks] = True

    def give(self, layer: int, slots: Iterable[int]) -> None:
        """Free `layer`'s slots of these blocks; a block whose slots are all free merges."""
        for b in slots:
            if not self.used[b, layer]:
                raise PlanError(f"layer {layer} slot of block {b} is not held")
            self.used[b, layer] = False
            if self.used[b].any():
                self.free_slots[layer] += 1
                self._free[layer].append(b)
            else:
                self.split[b] = False
                self.free_slots -= 1
                self.free_slots[layer] += 1
                self.blocks.take_back(b)
        if len(self._free[layer]) > 4 * self.blocks.num_blocks:
            self._compact(layer)

    def _split(self, b: int) -> None:
        self.split[b] = True
        self.free_slots += 1
        for free in self._free:
            free.append(b)

    def _compact(self, layer: int) -> None:
        valid = self.split & ~self.used[:, layer]
        self._free[layer] = [b for b in dict.fromkeys(self._free[layer]) if valid[b]]

    def check_invariants(self) -> None:
        assert np.array_equal(self.split, self.blocks.lent), "split blocks != lent blocks"
        assert not self.used[~self.split].any(), "a slot of an unsplit block is held"
        assert self.used[self.split].any(axis=1).all(), "a split block with no slot held"
        free = self.split[:, None] & ~self.used
        assert np.array_equal(free.sum(axis=0), self.free_slots), "free slot counts are off"
        if not self.free_slots.any():  # no free slot to be listed (nothing split, most steps)
            return
        for layer, entries in enumerate(self._free):
            listed = np.zeros(len(self.split), bool)
            listed[entries] = True
            assert not (free[:, layer] & ~listed).any(), f"a free slot of layer {layer} is unlisted"
