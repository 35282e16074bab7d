"""The engine's side of layer-wise KV residency (LayerKV): which requests keep only some
layers on the device, where each of their layers' blocks is, and the copies a change of
residency makes.

Only partly offloaded requests are known here: a fully resident request is an ordinary
`BlockManager` table, so nothing here runs for it (no Python per layer, nothing per step).
A partly offloaded request (a `PartialKV`) holds, per logical block, one device slot in
each kept layer and one host slot in each offloaded layer (`jserve.cache.layers`). Going
back to every layer makes it an ordinary request again: it takes whole blocks, and its
kept layers' slots are copied into them (device to device) beside the host layers coming
back, so decoding, growth and everything after never see slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.cache.layers import LayerSlab, kept_layers
from jserve.cache_features.layer_offload.batch import LayerMove, LayerTables


@dataclass
class PartialKV:
    """A partly offloaded request's blocks: per kept layer its device slots, per offloaded
    layer its host slots, each list in table order."""

    kept: tuple[int, ...]
    device: dict[int, list[int]]
    host: dict[int, list[int]]

    @property
    def num_blocks(self) -> int:
        return len(next(iter((self.device or self.host).values())))

    def tables(self, seq_id: int, num_layers: int) -> LayerTables:
        none = np.zeros(0, np.int32)
        return LayerTables(
            seq_id,
            device=tuple(np.asarray(self.device[l], np.int32) if l in self.device else none
                         for l in range(num_layers)),
            host=tuple(np.asarray(self.host[l], np.int32) if l in self.host else none
                       for l in range(num_layers)),
        )


@dataclass(frozen=True)
class LayerChange:
    """A residency change between its phases: the device slots of the layers a request
    stops keeping there (`lost`) and the host slots of those it gets back (`gained`), both
    already freed, by layer."""

    seq_id: int
    x: int
    lost: dict[int, list[int]]
    gained: dict[int, list[int]]


def _merges(split: np.ndarray, used: np.ndarray) -> tuple[int, np.ndarray]:
    """Split blocks with no slot held (they go back to whole), and the free slots per layer
    of the others."""
    held = used.any(axis=1)
    still = split & held
    return int((split & ~held).sum()), (still[:, None] & ~used).sum(axis=0)


@dataclass
class LayerMoves:
    """The copies a plan's residency changes make, all before the step's compute: every
    source is read before any destination is written (a slot one request frees may be
    another's destination in the same plan)."""

    to_host: list[LayerMove] = field(default_factory=list)
    to_device: list[LayerMove] = field(default_factory=list)
    device_copies: list[LayerMove] = field(default_factory=list)  # slots -> whole blocks


class LayerResidency:
    def __init__(self, blocks: BlockManager, host_blocks: BlockManager | None, num_layers: int) -> None:
        self.num_layers = num_layers
        self.blocks = blocks
        self.slab = LayerSlab(blocks, num_layers)
        self.host_slab = LayerSlab(host_blocks, num_layers) if host_blocks is not None else None
        self.partial: dict[int, PartialKV] = {}

    def kept(self, seq_id: int) -> tuple[int, ...]:
        part = self.partial.get(seq_id)
        return tuple(range(self.num_layers)) if part is None else part.kept

    # ------------------------------------------------------------ a plan's changes, in order
    def release_for(self, seq_id: int, x: int) -> LayerChange | None:
        """Phase 1 of setting `seq_id` to keep `x` layers: free what it stops holding (the
        device slots of layers it offloads or of every kept layer when it gets all of them
        back as whole blocks; the host slots of layers coming back), remembering where the
        K/V is for the copies. A fully resident request's whole blocks become split blocks
        first; a request that holds nothing yet (it starts now) only records its layers.
        None: nothing changes."""
        L, new = self.num_layers, kept_layers(self.num_layers, x)
        part = self.partial.get(seq_id)
        if part is None:
            if x == L:
                return None
            table = self.blocks.lend_table(seq_id)
            self.slab.adopt(table)
            if not table:
                self.partial[seq_id] = PartialKV(new, {l: [] for l in new},
                                                 {l: [] for l in range(L) if l not in new})
                return None
            part = self.partial[seq_id] = PartialKV(tuple(range(L)), {l: list(table) for l in range(L)}, {})
        if x == L:
            lost, gained = dict(part.device), dict(part.host)
        else:
            lost = {l: part.device.pop(l) for l in sorted(set(part.kept) - set(new))}
            gained = {l: part.host.pop(l) for l in sorted(set(new) - set(part.kept))}
        for layer, slots in lost.items():
            self.slab.give(layer, slots)
        for layer, host in gained.items():
            self.host_slab.give(layer, host)
        return LayerChange(seq_id, x, lost, gained)

    def make_whole(self, change: LayerChange, moves: LayerMoves) -> None:
        """Phase 2, for a request set back to every layer: whole blocks for its table (its
        own split blocks, where phase 1 freed all their slots, among the first the free list
        gives), its kept layers copied from their slots and its host layers brought back."""
        seq_id = change.seq_id
        part = self.partial.pop(seq_id)
        self.blocks.allocate(seq_id, part.num_blocks)
        whole = np.asarray(self.blocks.table(seq_id), np.int32)
        for layer, slots in change.lost.items():
            moves.device_copies.append(LayerMove(seq_id, layer, np.asarray(slots, np.int32), whole))
        for layer, host in change.gained.items():
            moves.to_device.append(LayerMove(seq_id, layer, np.asarray(host, np.int32), whole))

    def take_for(self, change: LayerChange, moves: LayerMoves) -> None:
        """Phase 3, for a request keeping fewer than all layers: host slots for the layers it
        offloads and device slots for those it gets back, with the copies."""
        seq_id, part = change.seq_id, self.partial[change.seq_id]
        for layer, slots in change.lost.items():
            host = part.host[layer] = self.host_slab.take(layer, len(slots))
            moves.to_host.append(LayerMove(seq_id, layer, np.asarray(slots, np.int32), np.asarray(host, np.int32)))
        for layer, host in change.gained.items():
            slots = part.device[layer] = self.slab.take(layer, len(host))
            moves.to_device.append(LayerMove(seq_id, layer, np.asarray(host, np.int32), np.asarray(slots, np.int32)))
        part.kept = kept_layers(self.num_layers, change.x)

    def room_after_releases(self, changes: Mapping[int, int], preempted: Iterable[int]
                            ) -> tuple[int, np.ndarray, int, np.ndarray]:
        """What phase 1 of these residency changes (seq -> layers kept) and the release of
        these preempted requests leave, computed on copies: (device blocks that merge back
        to whole, device free slots per layer after, the same two for the host)."""
        L = self.num_layers
        split, used = self.slab.split.copy(), self.slab.used.copy()
        host_used = None if self.host_slab is None else self.host_slab.used.copy()
        for seq_id in preempted:
            part = self.partial.get(seq_id)
            if part is not None:
                for layer, slots in part.device.items():
                    used[slots, layer] = False
                for layer, host in part.host.items():
                    host_used[host, layer] = False
        for seq_id, x in changes.items():
            part, new = self.partial.get(seq_id), set(kept_layers(L, x))
            if part is None:
                table = self.blocks.table(seq_id)
                if x < L and table:
                    split[table] = True
                    used[np.ix_(table, sorted(set(range(L)) - new))] = False
                    used[np.ix_(table, sorted(new))] = True
                continue
            for layer, slots in part.device.items():
                if x == L or layer not in new:
                    used[slots, layer] = False
            for layer, host in part.host.items():
                if x == L or layer in new:
                    host_used[host, layer] = False
        merged, free = _merges(split, used)
        if host_used is None:
            return merged, free, 0, np.zeros(L, np.int64)
        return (merged, free, *_merges(self.host_slab.split, host_used))

    def allocate(self, seq_id: int, n: int) -> None:
        """`n` more logical blocks of a partly offloaded request: a slot in each kept layer
        on the device and in each other layer on the host."""
        part = self.partial[seq_id]
        for layer, slots in part.device.items():
            slots += self.slab.take(layer, n)
        for layer, host in part.host.items():
            host += self.host_slab.take(layer, n)

    def release(self, seq_id: int) -> bool:
        """Free everything a partly offloaded request holds (finish, abort, preemption);
        False if it is fully resident (its table is the `BlockManager`'s to free)."""
        part = self.partial.pop(seq_id, None)
        if part is None:
            return False
        for layer, slots in part.device.items():
            self.slab.give(layer, slots)
        for layer, host in part.host.items():
            self.host_slab.give(layer, host)
        return True

    # ------------------------------------------------------------ reading
    def tables(self, seq_id: int) -> LayerTables:
        return self.partial[seq_id].tables(seq_id, self.num_layers)

    def free_slots(self) -> np.ndarray:
        return self.slab.free_slots.copy()

    def free_host_slots(self) -> np.ndarray | None:
        return None if self.host_slab is None else self.host_slab.free_slots.copy()

    def check_invariants(self, live_seqs: set[int]) -> None:
        """Each slot held by exactly one partial request, in the layers `kept_layers` names
        (device) or the others (host), every layer's list as long as the request's table."""
        assert set(self.partial) <= live_seqs, "layer slots held by a request that ended"
        self.slab.check_invariants()
        if self.host_slab is not None:
            self.host_slab.check_invariants()
        L = self.num_layers
        for pool, side in ((self.slab, "device"), (self.host_slab, "host")):
            if pool is None:
                continue
            if not self.partial:  # nothing holds a slot (most steps): none is used
                assert not pool.used.any(), f"{side} layer slots held != used"
                continue
            held = np.zeros_like(pool.used, np.int32)
            for seq_id, part in self.partial.items():
                for layer, slots in getattr(part, side).items():
                    np.add.at(held[:, layer], slots, 1)
            assert (held <= 1).all(), f"a {side} layer slot is held twice"
            assert np.array_equal(held > 0, pool.used), f"{side} layer slots held != used"
        for seq_id, part in self.partial.items():
            assert self.blocks.num_held(seq_id) == 0, f"partial seq {seq_id} also holds whole blocks"
            assert set(part.device) == set(part.kept) and set(part.host) == set(range(L)) - set(part.kept)
            assert len({len(s) for s in (*part.device.values(), *part.host.values())}) <= 1, \
                f"seq {seq_id}: layers with different numbers of blocks"
