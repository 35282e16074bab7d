"""What a policy returns: the engine state validates it and carries it out, or refuses."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


def _frozen(mapping: Mapping | None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


def _victims(preempt: Iterable[int]) -> tuple[int, ...]:
    if isinstance(preempt, Mapping):  # how to preempt is a cache feature's section
        raise TypeError("Plan.preempt takes seq ids, not a mapping; a swap is the swap tier's "
                        "section (jserve.cache_features.swap_tier.section.preemptions)")
    victims = tuple(int(s) for s in preempt)
    if len(set(victims)) != len(victims):
        raise ValueError(f"Plan.preempt names a request twice: {list(victims)}")
    return victims


@dataclass(frozen=True)
class Plan:
    """One iteration's decisions, keyed by `seq_id`, carried out in this order:

    1. `preempt`: release the device KV of these running requests, in this order; they
       wait to recompute from their first token, unless a cache feature keeps their KV
       (the swap tier moves it to host memory); blocks that also hold a prefix-cache entry
       stay cached;
    2. `evict`: drop these unreferenced blocks from the prefix cache (the engine fills this
       in from its eviction rule, after the policy: see `Engine.step`);
    3. the cache features' releases, then their whole-block takes (the swap tier's
       swap-ins bring swapped requests' KV back into fresh device blocks);
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
    state and books it in the order above: the preemptions it keeps as the core releases
    them; its releases after the evictions, before any take; its whole-block takes before
    the allocations; its other takes after them. A plan with a section does not repeat.

    `repeat`: how many steps in a row, this one included, the policy would plan the same
    decodes: every request in `run` computes its one new token, growing its table by a
    block when it fills one. It is a promise about the policy's own next plans (that the
    free blocks cover the growth, and that nothing else would be admitted, swapped in or
    preempted), valid while no request arrives, finishes or is aborted: the engine applies
    the later steps without asking the policy while none of those happens
    (`EngineState.apply_repeat`), and the simulator books several at once (`Engine.step`).
    Only a plan that runs nothing but one-token decodes, and preempts and evicts nothing,
    may repeat.
    """

    run: Mapping[int, int] = field(default_factory=dict)
    allocate: Mapping[int, int] = field(default_factory=dict)
    preempt: tuple[int, ...] = ()
    reserve: Mapping[int, int] = field(default_factory=dict)
    evict: frozenset[int] = frozenset()  # physical block ids
    repeat: int = 1
    features: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("run", "allocate", "reserve", "features"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        object.__setattr__(self, "preempt", _victims(self.preempt))
        object.__setattr__(self, "evict", frozenset(int(b) for b in self.evict))

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.run.values())
