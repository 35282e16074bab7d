"""Layer residency's part of a runner's `Batch` (`Batch.features["layer_offload"]`): the
per-layer copies a plan's residency changes make, where partly offloaded sequences' layers
live for the step, and the per-layer traffic the cost model prices."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jserve.cache_features.layer_offload.section import NAME

if TYPE_CHECKING:
    from jserve.engine.batch import Batch


@dataclass(frozen=True)
class LayerMove:
    """One layer of a request's K/V copied block by block, in table order, from `src` to
    `dst` block ids of that layer's pools (device -> host, host -> device, or device ->
    device, as the `LayerBatch` field it is in says)."""

    seq_id: int
    layer: int
    src: np.ndarray  # int32
    dst: np.ndarray  # int32


@dataclass(frozen=True)
class LayerTables:
    """Where a partly offloaded request's K/V lives, per layer: `device[l]` its blocks in
    layer `l`'s device pool (empty for an offloaded layer), `host[l]` its blocks in layer
    `l`'s host pool (empty for a kept layer)."""

    seq_id: int
    device: tuple[np.ndarray, ...]
    host: tuple[np.ndarray, ...]


@dataclass(frozen=True, slots=True)
class LayerTraffic:
    """What a step moves per layer, each `[L]`, in layer blocks (one block of one layer's K
    and V; `LayerBatch.traffic`) or in bytes (`in_bytes`: the cost model's term,
    `StepShape.layer_bytes`, hashable as the shape is):

    - `prefill_to_host`: the new K/V this step computes in offloaded layers (a prefill's
      every block, a decode's block its token lands in), written to the host as each layer
      computes (the paper overlaps each with the following layers);
    - `to_host`: retained layers offloaded before the step (device slots freed);
    - `to_device`: offloaded layers' blocks brought to the device before the layer
      computes: those brought back to stay, and the context a partly offloaded request
      that runs reads from the host for this step (LayerKV Section 4: "during the decode
      stage, KV cache is transferred layer-by-layer from host memory to GPU memory");
    - `device_copy`: kept layers' slots copied into whole blocks when a request gets every
      layer back (device memory to device memory)."""

    prefill_to_host: tuple[int, ...]
    to_host: tuple[int, ...]
    to_device: tuple[int, ...]
    device_copy: tuple[int, ...]

    def in_bytes(self, bytes_per_block: int) -> LayerTraffic:
        """This traffic, counted in layer blocks, in bytes; `bytes_per_block`: one block of
        every layer's K and V."""
        per_layer = bytes_per_block // len(self.to_host)
        return LayerTraffic(*(tuple(n * per_layer for n in getattr(self, f.name))
                              for f in dataclasses.fields(self)))


@dataclass(frozen=True)
class LayerBatch:
    """The step's layer work. Before the compute, after the swaps, every source read before
    any destination is written: `to_host` (device -> host), `to_device` (host -> device)
    and `copies` (device slots -> whole blocks). The step's own host traffic is not a copy
    list: a runner reads the offloaded layers' context of the sequences in `tables` (by
    batch index; a real runner's batch only) for the step and writes their new K/V back to
    the host. `traffic`: all of it per layer, None in a group's part (`sliced`)."""

    to_host: tuple[LayerMove, ...] = ()
    to_device: tuple[LayerMove, ...] = ()
    copies: tuple[LayerMove, ...] = ()
    tables: Mapping[int, LayerTables] = dataclasses.field(default_factory=dict)
    traffic: LayerTraffic | None = None

    @property
    def moves_blocks(self) -> bool:
        return self.traffic is not None

    def sliced(self, lo: int, hi: int) -> LayerBatch | None:
        tables = {i - lo: t for i, t in self.tables.items() if lo <= i < hi}
        return LayerBatch(tables=tables) if tables else None

    def shape_terms(self, batch: Batch, bytes_per_block: int) -> dict[str, object]:
        if self.traffic is None:
            return {}
        return {"layer_bytes": self.traffic.in_bytes(bytes_per_block)}


NO_LAYER_WORK = LayerBatch()


def layer_work(batch: Batch) -> LayerBatch:
    """The batch's layer work (`NO_LAYER_WORK` where it has none)."""
    return batch.features.get(NAME, NO_LAYER_WORK)
