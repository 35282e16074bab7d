"""What a policy returns: the engine state validates it and carries it out, or refuses."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


class PreemptMode(enum.Enum):
    RECOMPUTE = "recompute"  # drop the KV; the request re-prefills prompt + output later
    SWAP = "swap"  # move the KV to host memory; a later plan swaps it back in


def _frozen(mapping: Mapping | None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Plan:
    """One iteration's decisions, keyed by `seq_id`, carried out in this order:

    1. `preempt`: release the device KV of running requests (dropped, or swapped to host);
       blocks that also hold a prefix-cache entry stay cached;
    2. `evict`: drop these unreferenced blocks from the prefix cache (the engine fills this
       in from its eviction rule, after the policy: see `Engine.step`);
    3. `swap_in`: bring swapped requests' KV back into fresh device blocks (they become
       running, with all their computed tokens);
    4. `allocate`: grow a request's table by that many blocks. A waiting request whose
       prompt starts with cached blocks (the view shows them as its `num_computed`) takes
       those over as the first blocks of its table: they count in `allocate` but are
       shared, not copied, so the count is never less than the memory it costs;
    5. `run`: compute that many of each request's not-yet-cached tokens (a prefill chunk,
       a whole prompt, or 1 for a decode). Insertion order is batch order.
    6. `reserve`: set a request's reservation (blocks promised to it, materialised by later
       `allocate`s) to that many blocks; reservations are bookkeeping for policies that
       allocate a predicted demand (CacheOpt, RLP, S3), and their sum never exceeds the cache.

    Blocks a preemption frees may serve a swap-in or an allocation of the same plan: the
    runner copies swapped-out blocks before anything writes to them.

    `features`: each cache feature's section of the plan, by the feature's name
    (`jserve.cache_features`; a policy builds one through that feature's `section` module).
    The core checks and books whole blocks; each feature checks its section against the
    state and books it in the order above: its releases after the evictions, before any
    take; its whole-block takes with the swap-ins; its other takes after the allocations.
    A plan with a section does not repeat.

    `repeat`: how many steps in a row, this one included, the policy would plan the same
    decodes: every request in `run` computes its one new token, growing its table by a
    block when it fills one. It is a promise about the policy's own next plans (that the
    free blocks cover the growth, and that nothing else would be admitted, swapped in or
    preempted), valid while no request arrives, finishes or is aborted; the engine checks
    those events and may run fewer (see `Engine.step`). Only a plan that runs nothing but
    one-token decodes, and preempts, swaps and evicts nothing, may repeat.
    """

    run: Mapping[int, int] = field(default_factory=dict)
    allocate: Mapping[int, int] = field(default_factory=dict)
    preempt: Mapping[int, PreemptMode] = field(default_factory=dict)
    swap_in: frozenset[int] = frozenset()
    reserve: Mapping[int, int] = field(default_factory=dict)
    evict: frozenset[int] = frozenset()  # physical block ids
    repeat: int = 1
    features: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("run", "allocate", "preempt", "reserve", "features"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        object.__setattr__(self, "swap_in", frozenset(self.swap_in))
        object.__setattr__(self, "evict", frozenset(int(b) for b in self.evict))

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.run.values())
