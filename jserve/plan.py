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
    2. `swap_in`: bring swapped requests' KV back into fresh device blocks (they become
       running, with all their computed tokens);
    3. `allocate`: append that many fresh blocks to a request's table;
    4. `run`: compute that many of each request's not-yet-cached tokens (a prefill chunk,
       a whole prompt, or 1 for a decode). Insertion order is batch order.
    5. `reserve`: set a request's reservation (blocks promised to it, materialised by later
       `allocate`s) to that many blocks; reservations are bookkeeping for policies that
       allocate a predicted demand (CacheOpt, RLP, S3), and their sum never exceeds the cache.

    Blocks a preemption frees may serve a swap-in or an allocation of the same plan: the
    runner copies swapped-out blocks before anything writes to them.
    """

    run: Mapping[int, int] = field(default_factory=dict)
    allocate: Mapping[int, int] = field(default_factory=dict)
    preempt: Mapping[int, PreemptMode] = field(default_factory=dict)
    swap_in: frozenset[int] = frozenset()
    reserve: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("run", "allocate", "preempt", "reserve"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        object.__setattr__(self, "swap_in", frozenset(self.swap_in))


    @property
    def num_batched_tokens(self) -> int:
        return sum(self.run.values())
