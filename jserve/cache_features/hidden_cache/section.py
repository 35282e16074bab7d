"""The hidden cache's part of a plan, as a policy builds and reads it."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from jserve.engine.plan import Plan

NAME = "hidden_cache"


class CacheType(enum.IntEnum):
    """What a request's cache blocks hold (Apt-Serve's hybrid cache, Section 4.3): every
    layer's K and V (`KV`), or every layer's attention input rows (`HIDDEN`, after the
    attention norm), from which each step recomputes K and V. A hidden block holds
    `SchedulerView.hidden_block_tokens` tokens (twice `block_size` for MHA models)."""

    KV = 0
    HIDDEN = 1


@dataclass(frozen=True)
class CacheTypes:
    """A request's `CacheType` after the plan (absent: unchanged; a new request starts as
    `KV`). The type of a request that holds no device blocks (waiting, new or preempted by
    recompute, this plan's preemptions included) is simply set: it takes its blocks in
    that type when a plan allocates to it. A running request whose type changes switches
    the paper's way (Section 5: discard and recompute) within the plan: its blocks are
    released right after the preemptions, before any take (so they may serve the plan's
    allocations), its computed tokens drop to 0, and it must be in `run`, recomputing
    from its first token in the new type; `allocate` counts blocks of the new type. A
    switch is not a preemption. A hidden request is never swapped (preempt it by
    recompute), never shares prefix-cache blocks and keeps every layer on the device; a
    swapped or partly offloaded request cannot change type; a model whose block holds no
    hidden row (`hidden_block_tokens == 0`) cannot use `HIDDEN`."""

    types: Mapping[int, CacheType] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "types", MappingProxyType(dict(self.types)))


def section(types: Mapping[int, CacheType]) -> dict[str, CacheTypes]:
    """`Plan.features` entry setting these requests' types (none when `types` is empty)."""
    return {NAME: CacheTypes(types)} if types else {}


def cache_types(plan: Plan) -> Mapping[int, CacheType]:
    """The types a plan sets."""
    found = plan.features.get(NAME)
    return MappingProxyType({}) if found is None else found.types
