"""The swap tier's part of a plan, as a policy builds and reads it."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from jserve.engine.plan import Plan

NAME = "swap_tier"


class PreemptMode(enum.Enum):
    """How a policy preempts a victim: its KV dropped (it re-prefills prompt and output
    later) or swapped to the host tier (a later plan swaps it back in)."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(frozen=True)
class Swaps:
    """`out`: requests this plan preempts (each is in `Plan.preempt`) whose KV moves to the
    host tier rather than being dropped: they keep their computed tokens and wait as
    `SWAPPED`. Only a running request with every layer on the device, and not in another
    feature's state, is swapped, and all its blocks must fit the host's free ones.
    `back`: swapped requests whose KV comes back into fresh device blocks (a whole-block
    take, with the features' others, before the plan's allocations); they are running
    again, with all their computed tokens, and may run in this plan."""

    out: frozenset[int] = frozenset()
    back: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", frozenset(self.out))
        object.__setattr__(self, "back", frozenset(self.back))


def preemptions(preempt: Mapping[int, PreemptMode], swap_in: Iterable[int] = ()) -> dict[str, object]:
    """`Plan` arguments for victims by mode (in preemption order) and swap-ins: `preempt`
    and, when anything is swapped, the swap tier's section."""
    out = frozenset(s for s, mode in preempt.items() if mode is PreemptMode.SWAP)
    back = frozenset(swap_in)
    return {"preempt": tuple(preempt), "features": {NAME: Swaps(out, back)} if out or back else {}}


def swaps(plan: Plan) -> Swaps:
    """The plan's swaps (none when it has no section)."""
    return plan.features.get(NAME) or Swaps()


def preempt_modes(plan: Plan) -> dict[int, PreemptMode]:
    """The plan's victims, in order, and how each is preempted (`preemptions` read back)."""
    out = swaps(plan).out
    return {s: PreemptMode.SWAP if s in out else PreemptMode.RECOMPUTE for s in plan.preempt}
