"""Layer residency's part of a plan and of the view, as a policy builds and reads them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from jserve.engine.plan import Plan
from jserve.engine.view import SchedulerView

NAME = "layer_offload"
COLUMN = "device_layers"  # its request table column


@dataclass(frozen=True)
class KeptLayers:
    """How many of a request's layers keep their KV on the device after the plan
    (`jserve.cache.layers.kept_layers` says which; absent: unchanged), booked after the
    plan's swap-ins and before its allocations. Fewer than now offloads layers (their
    device slots freed, host slots taken, copied before the step), more brings them back
    (host -> device before the step); all of them makes it an ordinary request again, in
    whole blocks (it takes as many whole blocks as its table has; its slots are freed
    first, so its own split blocks that become entirely free count among them). Every
    release of a plan comes before any take, and whole blocks are taken before layer
    slots. A request that starts now keeping fewer than all runs its whole prompt in this
    step and its offloaded layers' new KV goes to host memory as it is computed. A request
    with fewer than all layers may run any tokens (a decode, as LayerKV's Section 4 has
    it): for the step, its offloaded layers' context is read from the host to the device
    layer by layer, and the new K/V is written back; a repeated plan runs only requests
    with every layer on the device. For a request that keeps `x` of `L` layers after the
    plan, each block it allocates is `x` layer slots on the device and `L - x` on the
    host."""

    layers: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", MappingProxyType(dict(self.layers)))


def section(layers: Mapping[int, int]) -> dict[str, KeptLayers]:
    """`Plan.features` entry setting these requests' kept layers (none when empty)."""
    return {NAME: KeptLayers(layers)} if layers else {}


def kept(plan: Plan) -> Mapping[int, int]:
    """The kept layers a plan sets."""
    found = plan.features.get(NAME)
    return MappingProxyType({}) if found is None else found.layers


@dataclass(frozen=True)
class LayerView:
    """Layer residency's part of the view. The view's `num_free_blocks` counts whole blocks
    (free in every layer); blocks split into per-layer slots for partly offloaded requests
    are not in it, and their free slots are `free_slots[l]` per layer (`free_host_slots`,
    the host tier's; None: all zero). `device_layers`: how many layers each of the view's
    requests keeps on the device (`num_layers`: all of them; read with `device_layers(view)`)."""

    num_layers: int = 1
    free_slots: np.ndarray | None = None
    free_host_slots: np.ndarray | None = None
    device_layers: np.ndarray | None = None  # [N] int16, aligned with `view.requests`; None: all


def layer_view(view: SchedulerView) -> LayerView:
    return view.features.get(NAME, LayerView())


def device_layers(view: SchedulerView) -> np.ndarray:
    """[N] int16: how many layers each of the view's requests keeps on the device (which
    ones: `jserve.cache.layers.kept_layers`), aligned with `view.requests`."""
    layers = layer_view(view)
    if layers.device_layers is None:
        return np.full(len(view.requests), layers.num_layers, np.int16)
    return layers.device_layers


def num_free_layer_blocks(view: SchedulerView) -> int:
    """Device layer slots free, summed over layers: `num_layers` per whole free block plus
    the free slots of split blocks (a request keeping `x` layers takes `x` per logical
    block)."""
    layers = layer_view(view)
    return layers.num_layers * view.num_free_blocks + _total(layers.free_slots)


def num_free_host_layer_blocks(view: SchedulerView) -> int:
    """Host layer slots free, summed over layers (a request keeping `x` layers takes
    `num_layers - x` per logical block)."""
    layers = layer_view(view)
    return layers.num_layers * view.num_free_host_blocks + _total(layers.free_host_slots)


def _total(slots: np.ndarray | None) -> int:
    return 0 if slots is None else int(slots.sum())
