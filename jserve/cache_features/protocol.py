"""The one protocol a cache feature implements: a hook per stage of the loop, so that the
core checks and books whole blocks and asks each feature only where its requests differ."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.engine.batch import Batch
from jserve.engine.live_requests import LiveRequests
from jserve.engine.plan import Plan
from jserve.engine.prefix_reuse import PrefixReuse

NO_ROWS = np.zeros(0, np.int64)


@dataclass(frozen=True)
class StateParts:
    """The engine state's parts a feature reads and changes."""

    live: LiveRequests
    blocks: BlockManager
    host_blocks: BlockManager | None
    reuse: PrefixReuse | None


@dataclass(frozen=True)
class SectionCheck:
    """What a feature's check found in its plan section: what the core must know of it
    (`discarded`: running requests whose blocks go back before any take, recomputing from
    their first token in this plan) and what the feature's own `apply` books (`booking`)."""

    discarded: np.ndarray = field(default_factory=NO_ROWS.copy)
    booking: object = None


NOTHING = SectionCheck()


class CacheFeature(Protocol):
    """A cache feature's hooks, in loop order. `name` keys its section in `Plan.features`;
    a plan naming a feature that is not registered is refused."""

    name: str

    def check(self, plan: Plan) -> SectionCheck:
        """Its plan section (and the rules it adds to the core's sections) against the
        state; `PlanError` for the first offender. Runs after the core's preemption and
        swap-in checks, before any block count."""

    def block_tokens(self, rows: np.ndarray, plan: Plan | None = None) -> np.ndarray | None:
        """Tokens one block of each of `rows` holds (after `plan` when given), or None
        where the feature leaves every request at `block_size`."""

    def release(self, checked: SectionCheck) -> None:
        """Book its section's releases: after the plan's preemptions and evictions, before
        any take (so what it frees may serve this plan's allocations)."""

    def allows_repeat(self, batch: Batch) -> bool:
        """Whether the just-run `batch`'s decodes may repeat (`Plan.repeat`)."""

    def check_invariants(self, prefix_cache: bool) -> None:
        """What must hold of its requests between steps."""
