"""The hidden cache's part of a plan and of the view, as a policy builds and reads them."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from jserve.engine.plan import Plan
from jserve.engine.view import SchedulerView, Tokens

NAME = "hidden_cache"
COLUMN = "cache_type"  # its request table column


class CacheType(enum.IntEnum):
    """What a request's cache blocks hold (Apt-Serve's hybrid cache, Section 4.3): every
    layer's K and V (`KV`), or every layer's attention input rows (`HIDDEN`, after the
    attention norm), from which each step recomputes K and V. A hidden block holds
    `HiddenView.block_tokens` tokens (twice `block_size` for MHA models)."""

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


@dataclass(frozen=True)
class HiddenView:
    """The hidden cache's part of the view: tokens one block holds as hidden rows (0: the
    model cannot use it), rho, the seconds a step takes longer per hidden block in the
    batch (0.0: unknown), and each of the view's requests' `CacheType` (`request_types`)."""

    block_tokens: int = 0
    block_cost: float = 0.0
    types: np.ndarray | None = None  # [N] int8, aligned with `view.requests`; None: all KV


def hidden_view(view: SchedulerView) -> HiddenView:
    return view.features.get(NAME, HiddenView())


def request_types(view: SchedulerView) -> np.ndarray:
    """[N] int8: the `CacheType` of each of the view's requests, aligned with `view.requests`."""
    types = hidden_view(view).types
    return np.zeros(len(view.requests), np.int8) if types is None else types


def blocks_for_type(view: SchedulerView, num_tokens: Tokens, cache_type: Tokens) -> Tokens:
    """Blocks that hold `num_tokens` tokens in `cache_type` (`CacheType`; one request, or
    elementwise for many); a hidden type when the model cannot use it raises."""
    tokens = hidden_view(view).block_tokens
    hidden = np.asarray(cache_type) == CacheType.HIDDEN
    if hidden.any() and tokens < 1:
        raise ValueError("this model's blocks hold no hidden row (hidden_block_tokens == 0)")
    per_block = np.where(hidden, max(tokens, 1), view.block_size)
    out = -(-np.asarray(num_tokens) // per_block)
    return int(out) if np.ndim(out) == 0 else out
