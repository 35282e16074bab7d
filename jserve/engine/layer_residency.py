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

from dataclasses import dataclass, field

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.cache.layers import LayerSlab, kept_layers
from jserve.engine.batch import LayerMove, LayerTables


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
    def offload(self, seq_id: int, x: int, moves: LayerMoves) -> None:
        """First phase of setting `seq_id` to keep `x` layers: the layers it stops keeping
        go to the host (their device slots freed). A fully resident request's whole blocks
        become split blocks it keeps the slots of `x` layers in; a request that holds
        nothing yet (it starts now) only records which layers it will keep."""
        L, new = self.num_layers, kept_layers(self.num_layers, x)
        part = self.partial.get(seq_id)
        if part is None:
            if x == L:
                return
            table = self.blocks.lend_table(seq_id)
            self.slab.adopt(table)
            part = self.partial[seq_id] = PartialKV(tuple(range(L)), {l: list(table) for l in range(L)}, {})
            if not table:
                part.device = {l: [] for l in new}
                part.host = {l: [] for l in range(L) if l not in part.device}
                part.kept = new
                return
        if x == L:
            return
        for layer in sorted(set(part.kept) - set(new)):
            slots = part.device.pop(layer)
            host = self.host_slab.take(layer, len(slots))
            moves.to_host.append(LayerMove(seq_id, layer, np.asarray(slots, np.int32), np.asarray(host, np.int32)))
            self.slab.give(layer, slots)
            part.host[layer] = host
        part.kept = tuple(sorted(set(part.kept) & set(new)))

    def make_whole(self, seq_id: int, moves: LayerMoves) -> None:
        """Second phase, for a request set back to every layer: whole blocks for its table,
        its kept slots copied into them and its host layers brought back, slots freed."""
        part = self.partial.pop(seq_id)
        n = part.num_blocks
        self.blocks.allocate(seq_id, n)
        whole = np.asarray(self.blocks.table(seq_id), np.int32)
        for layer, slots in part.device.items():
            moves.device_copies.append(LayerMove(seq_id, layer, np.asarray(slots, np.int32), whole))
            self.slab.give(layer, slots)
        for layer, host in part.host.items():
            moves.to_device.append(LayerMove(seq_id, layer, np.asarray(host, np.int32), whole))
            self.host_slab.give(layer, host)

    def bring_back(self, seq_id: int, x: int, moves: LayerMoves) -> None:
        """Third phase, for a request that keeps more layers but not all: device slots for
        the layers it gains, copied from the host (host slots freed)."""
        part = self.partial[seq_id]
        new = kept_layers(self.num_layers, x)
        for layer in sorted(set(new) - set(part.kept)):
            host = part.host.pop(layer)
            slots = self.slab.take(layer, len(host))
            moves.to_device.append(LayerMove(seq_id, layer, np.asarray(host, np.int32), np.asarray(slots, np.int32)))
            self.host_slab.give(layer, host)
            part.device[layer] = slots
        part.kept = new

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
