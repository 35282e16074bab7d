"""Refusing a plan the state cannot honour, before anything changes.

A plan that names a request that is not live, preempts one that is not running, runs
tokens nobody holds blocks for, or takes more blocks than are free is a policy bug: it
raises `PlanError` naming the first offender in plan order, never trimmed. The checks are
whole-array comparisons over the requests' columns (a plan runs up to a few hundred
requests every step), and the table rows they find are handed on, so applying the plan
and building its batch look nothing up again.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.cache.prefix import PrefixHit
from jserve.cache_features.protocol import NO_ROWS, CacheFeature, SectionCheck
from jserve.cache_features.registry import block_tokens, check_sections_known, refuse_shared
from jserve.engine.live_requests import LiveRequests
from jserve.engine.plan import Plan
from jserve.engine.prefix_reuse import PrefixReuse
from jserve.engine.refusal import member, not_live, refuse_first, values
from jserve.engine.request import OFFLOADED, RUNNING
from jserve.engine.view import SchedulerLimits
from jserve.errors import PlanError


@dataclass(frozen=True)
class CheckedPlan:
    """A plan that passed, with the table rows of the requests it names (in the order of
    the plan's mappings) and the cached prefixes the requests it starts take over."""

    plan: Plan
    hits: dict[int, PrefixHit]
    preempt_rows: np.ndarray
    allocate_rows: np.ndarray
    allocate_counts: np.ndarray
    run_rows: np.ndarray
    run_lens: np.ndarray
    reserve_rows: np.ndarray
    reserve_counts: np.ndarray
    own_allocations: frozenset[int]  # seq ids whose allocation a cache feature books
    sections: tuple[SectionCheck, ...]  # each cache feature's, in the registry's order
    discarded: np.ndarray  # running requests a feature's section discards (recompute from 0)


@dataclass(frozen=True)
class PlanChecker:
    live: LiveRequests
    blocks: BlockManager
    limits: SchedulerLimits
    reuse: PrefixReuse | None
    features: tuple[CacheFeature, ...] = ()

    def check(self, plan: Plan) -> CheckedPlan:
        """The plan with its rows, or `PlanError` for the first thing it gets wrong."""
        preempt_rows = self._check_preemptions(plan)
        check_sections_known(plan, self.features)
        sections = tuple(feature.check(plan) for feature in self.features)
        refuse_shared(plan, self.features, sections)
        switch_rows = np.concatenate([NO_ROWS, *(c.discarded for c in sections)])
        discarded = list(plan.preempt)
        if len(switch_rows):
            discarded += self.live.cols.seq_id[switch_rows].tolist()
        released = self.blocks.released_by(discarded)
        hits = {} if self.reuse is None else self.reuse.admitted_hits(plan)
        self._check_evictions(plan, released, hits)
        allocate_rows, allocate_counts = self._check_allocations(plan, hits)
        wanted = self._fresh_allocations(plan, hits) + sum(c.whole_taken for c in sections)
        available = (self.blocks.num_free + self._uncached(released) + len(plan.evict)
                     + sum(c.whole_freed for c in sections))
        if wanted > available:
            raise PlanError(f"plan takes {wanted} blocks, {available} free")
        to_host = sum(c.to_host for c in sections)
        for feature, checked in zip(self.features, sections):
            feature.check_room(checked, available - wanted, to_host)
        lim = self.limits
        if len(plan.run) > lim.max_num_seqs:
            raise PlanError(f"plan runs {len(plan.run)} sequences, max_num_seqs is {lim.max_num_seqs}")
        if plan.num_batched_tokens > lim.max_num_batched_tokens:
            raise PlanError(
                f"plan runs {plan.num_batched_tokens} tokens, max_num_batched_tokens is "
                f"{lim.max_num_batched_tokens}"
            )
        reserve_rows, reserve_counts = self._check_reservations(plan, preempt_rows, switch_rows)
        run_rows, run_lens = self._check_runs(plan, switch_rows)
        if plan.repeat != 1:
            self._check_repeat(plan, run_rows, run_lens)
        return CheckedPlan(plan, hits, preempt_rows, allocate_rows, allocate_counts,
                           run_rows, run_lens, reserve_rows, reserve_counts,
                           frozenset().union(*(c.own_allocations for c in sections)),
                           sections, switch_rows)

    def _check_preemptions(self, plan: Plan) -> np.ndarray:
        """Rows of the requests it preempts."""
        if not plan.preempt:
            return NO_ROWS
        seq_ids, rows = plan.preempt, self.live.rows(plan.preempt)
        status = self.live.cols.status[rows]
        refuse_first(seq_ids, [
            not_live(seq_ids, rows, "preempt"),
            ((status != RUNNING) & (status != OFFLOADED),
             lambda i: f"seq {seq_ids[i]}: only running requests can be preempted"),
        ])
        return rows

    def _check_evictions(self, plan: Plan, released: np.ndarray, hits: dict[int, PrefixHit]) -> None:
        if not plan.evict:
            return
        if self.reuse is None:
            raise PlanError("plan evicts blocks but the engine has no prefix cache")
        evict = np.fromiter(plan.evict, np.int64, len(plan.evict))
        if evict.min() < 0 or evict.max() >= self.blocks.num_blocks:
            raise PlanError(f"plan evicts block ids outside [0, {self.blocks.num_blocks})")
        cached = self.reuse.index.cached
        unreferenced = self.blocks.ref_counts == 0
        unreferenced[released] = True
        bad = evict[~(cached[evict] & unreferenced[evict])]
        if len(bad):
            raise PlanError(f"plan evicts blocks {sorted(bad.tolist())[:8]} that are not cached "
                            "or that a request still uses")
        pinned = {b for hit in hits.values() for b in hit.device}
        if pinned & plan.evict:
            raise PlanError(f"plan evicts blocks {sorted(pinned & plan.evict)[:8]} that a request "
                            "it starts takes from the cache")

    def _check_allocations(self, plan: Plan, hits: dict[int, PrefixHit]) -> tuple[np.ndarray, np.ndarray]:
        seq_ids, rows, counts = list(plan.allocate), self.live.rows(plan.allocate), values(plan.allocate)
        cached = {s: hit.num_blocks for s, hit in hits.items()}
        least = np.fromiter(map(cached.get, seq_ids, repeat(0)), np.int64, len(seq_ids))
        refuse_first(seq_ids, [
            not_live(seq_ids, rows, "allocate to"),
            (counts < least, lambda i: f"seq {seq_ids[i]}: allocates {counts[i]} blocks, fewer than "
                                       f"the {least[i]} cached ones its table starts with"),
            (counts < 0, lambda i: f"seq {seq_ids[i]}: cannot allocate {counts[i]} blocks"),
            (member(seq_ids, plan.preempt),
             lambda i: f"seq {seq_ids[i]}: allocated to and preempted in the same plan"),
        ])
        return rows, counts

    def _check_reservations(self, plan: Plan, preempt_rows: np.ndarray, switch_rows: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray]:
        if not plan.reserve:
            return NO_ROWS, NO_ROWS
        seq_ids, rows, counts = list(plan.reserve), self.live.rows(plan.reserve), values(plan.reserve)
        preempted = member(seq_ids, plan.preempt)
        refuse_first(seq_ids, [
            not_live(seq_ids, rows, "reserve for"),
            ((counts < 0) | preempted, lambda i: f"seq {seq_ids[i]}: cannot reserve {counts[i]} blocks"
                                                 + (" and preempt it" if preempted[i] else "")),
        ])
        promised = self.live.cols.reserved_blocks.copy()
        promised[switch_rows] = 0
        promised[rows] = counts
        promised[preempt_rows] = 0
        total = int(promised[self.live.table.live_mask].sum())
        if total > self.blocks.num_blocks:
            raise PlanError(f"plan reserves {total} blocks in all, the cache has {self.blocks.num_blocks}")
        return rows, counts

    def _check_runs(self, plan: Plan, switch_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cols, bs = self.live.cols, self.blocks.block_size
        seq_ids, rows, n = list(plan.run), self.live.rows(plan.run), values(plan.run)
        computed, total = cols.num_computed[rows], cols.num_tokens[rows]
        allocated = np.fromiter(map(plan.allocate.get, seq_ids, repeat(0)), np.int64, len(seq_ids))
        held = cols.num_blocks[rows] + cols.num_host_blocks[rows] + allocated
        if len(switch_rows):  # discarded: recompute from token 0
            switched = np.isin(rows, switch_rows)
            computed, held = np.where(switched, 0, computed), np.where(switched, allocated, held)
        bs = block_tokens(self.features, bs, rows, plan)
        end = computed + n
        refuse_first(seq_ids, [
            not_live(seq_ids, rows, "run"),
            (member(seq_ids, plan.preempt), lambda i: f"seq {seq_ids[i]}: run and preempted in the same plan"),
            ((n < 1) | (end > total), lambda i: f"seq {seq_ids[i]}: cannot run {n[i]} tokens with "
                                                f"{computed[i]} of {total[i]} computed"),
            (held * bs < end, lambda i: f"seq {seq_ids[i]}: holds {held[i]} blocks, needs "
                                        f"{-(-int(end[i]) // int(np.broadcast_to(bs, end.shape)[i]))} "
                                        f"for {end[i]} tokens"),
        ])
        return rows, n

    def _check_repeat(self, plan: Plan, rows: np.ndarray, n: np.ndarray) -> None:
        """Only steps of plain decodes repeat (`Plan.repeat`)."""
        if plan.repeat < 1:
            raise PlanError(f"plan repeats {plan.repeat} times; at least once")
        if plan.preempt or plan.evict or plan.features:
            raise PlanError("a plan that preempts, evicts or has a cache feature's section "
                            "cannot repeat")
        decoding = (n == 1) & (self.live.cols.num_tokens[rows] - self.live.cols.num_computed[rows] == 1)
        if not decoding.all():
            seq = list(plan.run)[int(np.argmin(decoding))]
            raise PlanError(f"seq {seq}: a repeated plan runs only one-token decodes")

    @staticmethod
    def _fresh_allocations(plan: Plan, hits: dict[int, PrefixHit]) -> int:
        """Blocks the plan's allocations take off the free list: less the cached blocks
        they take over."""
        return sum(plan.allocate.values()) - sum(len(h.device) for h in hits.values())

    def _uncached(self, released: np.ndarray) -> int:
        return len(released) if self.reuse is None else self.reuse.uncached(released)

    def shortfall(self, plan: Plan, released: np.ndarray, hits: dict[int, PrefixHit]) -> int:
        """Blocks the plan needs beyond those free now or freed by its preemptions (before
        it is checked: the features say what their sections want)."""
        wanted = self._fresh_allocations(plan, hits) + sum(f.blocks_wanted(plan) for f in self.features)
        return wanted - self.blocks.num_free - self._uncached(released)
