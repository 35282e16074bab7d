"""The engine's side of the hidden cache: its plan section checked against the state and
booked, the tokens its blocks hold, and what must hold of its requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from jserve.cache_features.hidden_cache.batch import HiddenBatch
from jserve.cache_features.hidden_cache.section import COLUMN, NAME, CacheType, HiddenView, cache_types
from jserve.cache_features.protocol import NOTHING, CacheFeature, Runs, SectionCheck, StateParts
from jserve.engine.plan import Plan
from jserve.engine.refusal import member, not_live, refuse_first
from jserve.engine.request import OFFLOADED, RUNNING, SWAPPED


def types_after(plan: Plan, seq_ids: Sequence[int], now: np.ndarray) -> np.ndarray:
    """Cache types of `seq_ids` after `plan` (their types `now` where it sets none)."""
    types = cache_types(plan)
    if not types:
        return now
    return np.fromiter(map(types.get, seq_ids, now.tolist()), np.int64, len(seq_ids))


@dataclass(frozen=True)
class TypeChanges:
    """A checked section: its requests' rows and types after the plan, in its order."""

    rows: np.ndarray
    types: np.ndarray


@dataclass(frozen=True)
class HiddenCache(CacheFeature):
    """`tokens`: tokens one block holds as hidden rows
    (`jserve.cache.sizing.hidden_block_tokens`; 0: the model cannot use it); `cost`: rho,
    the extra step seconds per hidden block, which the view hands policies (0.0: unknown)."""

    parts: StateParts
    tokens: int
    cost: float
    name: ClassVar[str] = NAME

    @classmethod
    def build(cls, parts: StateParts, *, hidden_block_tokens: int = 0, hidden_block_cost: float = 0.0,
              **_: object) -> HiddenCache:
        if hidden_block_tokens < 0 or hidden_block_cost < 0:
            raise ValueError(f"hidden_block_tokens and hidden_block_cost must be >= 0, got "
                             f"{hidden_block_tokens}, {hidden_block_cost}")
        return cls(parts, hidden_block_tokens, hidden_block_cost)

    def __post_init__(self) -> None:
        self.parts.live.table.add_column(COLUMN, np.int8, CacheType.KV)

    def _types(self) -> np.ndarray:
        """Every table row's `CacheType`."""
        return self.parts.live.table.columns[COLUMN]

    def view_section(self, rows: np.ndarray) -> HiddenView:
        # With a prefix cache no request may take the hidden cache, so policies are told
        # it is unavailable.
        return HiddenView(self.tokens if self.parts.reuse is None else 0, self.cost, self._types().take(rows))

    def check(self, plan: Plan) -> SectionCheck:
        types = cache_types(plan)
        if not types:
            return NOTHING
        cols = self.parts.live.cols
        seq_ids, rows = list(types), self.parts.live.rows(types)
        after = np.fromiter(map(int, types.values()), np.int64, len(rows))
        hidden = after == CacheType.HIDDEN
        status = cols.status[rows]
        changes = after != self._types()[rows]
        preempted = member(seq_ids, plan.preempt)
        switching = changes & (status == RUNNING) & ~preempted
        refuse_first(seq_ids, [
            not_live(seq_ids, rows, "set the cache type of"),
            ((after < 0) | (after > 1), lambda i: f"seq {seq_ids[i]}: unknown cache type {after[i]}"),
            (hidden & (self.tokens < 1),
             lambda i: f"seq {seq_ids[i]}: this model's block holds no hidden row "
                       "(hidden_block_tokens == 0), so it cannot use the hidden cache"),
            (hidden & (self.parts.reuse is not None),
             lambda i: f"seq {seq_ids[i]}: a hidden-cache request cannot share prefix-cache blocks; "
                       "build the engine without a prefix cache"),
            (changes & (status == SWAPPED),
             lambda i: f"seq {seq_ids[i]}: is swapped out; swap it in (or let it run) before "
                       "changing its cache type"),
            (changes & (status == OFFLOADED) & ~preempted,
             lambda i: f"seq {seq_ids[i]}: has layers on the host; preempt it by recompute to "
                       "change its cache type"),
            (switching & ~member(seq_ids, plan.run),
             lambda i: f"seq {seq_ids[i]}: switches cache type while running, so it must recompute "
                       "in this plan's run (or be preempted by recompute)"),
        ])
        return SectionCheck(discarded=rows[switching], booking=TypeChanges(rows, after),
                            claims=tuple(s for s, h in zip(seq_ids, hidden.tolist()) if h))

    def holds_after(self, seq_ids: list[int], plan: Plan) -> np.ndarray:
        rows = self.parts.live.rows(seq_ids)
        types = types_after(plan, seq_ids, self._types()[rows])
        return (types == CacheType.HIDDEN) & (rows >= 0)

    def block_tokens(self, rows: np.ndarray, plan: Plan | None = None) -> np.ndarray | None:
        if not self.tokens:
            return None
        types = self._types()[rows]
        if plan is not None:
            types = types_after(plan, self.parts.live.cols.seq_id[rows].tolist(), types)
        if not types.any():
            return None
        return np.where(types == CacheType.HIDDEN, self.tokens, self.parts.blocks.block_size)

    def release(self, checked: SectionCheck) -> None:
        """Set the section's types; a running request that switches discards its blocks
        (like a recompute preemption) and recomputes from its first token in this plan."""
        changes: TypeChanges | None = checked.booking
        if changes is None:
            return
        cols, rows = self.parts.live.cols, checked.discarded
        for seq_id in cols.seq_id[rows].tolist():
            self.parts.blocks.free(seq_id)
        cols.num_blocks[rows] = 0
        cols.num_computed[rows] = 0
        cols.reserved_blocks[rows] = 0
        self._types()[changes.rows] = changes.types

    # ------------------------------------------------------------------ the runner's work
    def batch_section(self, checked: SectionCheck, runs: Runs, with_inputs: bool) -> HiddenBatch | None:
        mask = self._types()[runs.rows] == CacheType.HIDDEN
        return HiddenBatch(mask) if mask.any() else None

    def check_invariants(self, prefix_cache: bool) -> None:
        """Hidden requests exist only on a model that can hold them, without a prefix
        cache, never swapped or partly offloaded."""
        live, cols = self.parts.live, self.parts.live.cols
        rows = live.live_rows()
        types = self._types()[rows]
        assert np.isin(types, [int(t) for t in CacheType]).all(), "unknown cache type"
        hidden = rows[types == CacheType.HIDDEN]
        if not len(hidden):
            return
        seq = int(cols.seq_id[hidden[0]])
        assert self.tokens > 0, f"hidden seq {seq} on a model without a hidden cache"
        assert not prefix_cache, f"hidden seq {seq} with a prefix cache"
        assert (cols.status[hidden] != OFFLOADED).all(), "a hidden seq is partly offloaded"
        assert ((cols.status[hidden] != SWAPPED) & (cols.num_host_blocks[hidden] == 0)).all(), \
            "a hidden seq is swapped"

