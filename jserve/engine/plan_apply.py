"""Carrying out a checked plan, in the order `Plan` documents: preemptions release KV
(dropped, or kept by a cache feature: the swap tier moves it to the host), evictions drop
cached blocks, cache features release what their sections give up and take their whole
blocks (swap-ins bring KV back), allocations grow tables (a started request first taking
over its cached prefix), then the requests that run and the reservations are booked.

Every release comes before any take, whole blocks (features' whole-block takes, then
allocations) before a feature's other takes: the order `PlanChecker`'s counting assumes. A
block a release frees may so serve a take of the same plan; runners read every source
before writing anything.

Nothing here checks anything: `PlanChecker` has, and a checked plan always applies.
What comes out is the block copies the runner must make before the step's compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.cache_features.protocol import CacheFeature, SectionCheck
from jserve.cache_features.registry import block_tokens
from jserve.engine.batch import BlockMove
from jserve.engine.live_requests import LiveRequests
from jserve.engine.plan_check import CheckedPlan
from jserve.engine.prefix_reuse import PrefixReuse
from jserve.engine.request import RUNNING, WAITING
from jserve.errors import PlanError


@dataclass(frozen=True)
class Moves:
    """The copies an applied plan makes before its step's compute: device blocks to the
    host (swap-outs, prefix-cache demotions) and back (swap-ins, prefix-cache loads)."""

    swap_out: tuple[BlockMove, ...] = ()
    swap_in: tuple[BlockMove, ...] = ()

    @classmethod
    def joined(cls, features: list[tuple[Sequence[BlockMove], Sequence[BlockMove]]],
               swap_out: list[BlockMove], swap_in: list[BlockMove]) -> Moves:
        """The features' copies, then the core's (prefix-cache demotions and loads)."""
        return cls(tuple(m for out, _ in features for m in out) + tuple(swap_out),
                   tuple(m for _, back in features for m in back) + tuple(swap_in))


NO_MOVES = Moves()


@dataclass(frozen=True)
class PlanApplier:
    live: LiveRequests
    blocks: BlockManager
    reuse: PrefixReuse | None
    features: tuple[CacheFeature, ...] = ()

    def apply(self, checked: CheckedPlan, now: float) -> Moves:
        plan, booked = checked.plan, tuple(zip(self.features, checked.sections))
        self._preempt(checked, booked, now)
        demoted = self.reuse.evict(sorted(plan.evict), checked.hits) if plan.evict else []
        for feature, section in booked:
            feature.release(section)
        for feature, section in booked:
            feature.take_whole(section)
        loads = self._allocate(checked)
        for feature, section in booked:
            feature.take_slots(section)
        self._start_runs(checked, now)
        for feature, section in booked:
            feature.after_runs(section, checked.run_rows)
        self.live.cols.reserved_blocks[checked.reserve_rows] = checked.reserve_counts
        return Moves.joined([feature.moves(section) for feature, section in booked], demoted, loads)

    def _preempt(self, checked: CheckedPlan, booked: tuple[tuple[CacheFeature, SectionCheck], ...],
                 now: float) -> None:
        cols = self.live.cols
        for seq_id, row in zip(checked.plan.preempt, checked.preempt_rows.tolist()):
            for feature in self.features:
                feature.drop(seq_id, row)
            held = np.asarray(self.blocks.table(seq_id), np.int32)
            self.blocks.free(seq_id)
            cols.num_blocks[row] = 0
            cols.reserved_blocks[row] = 0
            if not any(feature.keep(section, seq_id, row, held) for feature, section in booked):
                cols.num_computed[row] = 0
                cols.status[row] = WAITING
            cols.num_preemptions[row] += 1
            metrics = self.live.requests[seq_id].metrics
            metrics.num_preemptions += 1
            metrics.last_preempted_at = now
            self.live.awaiting_run.add(seq_id)

    def block_tokens(self, rows: np.ndarray) -> np.ndarray | int:
        """Tokens one block of each of `rows` holds (a cache feature's may differ)."""
        return block_tokens(self.features, self.blocks.block_size, rows)

    def _allocate(self, checked: CheckedPlan) -> list[BlockMove]:
        """Grow the tables by whole blocks; returns the copies that load host-tier cached
        blocks. Allocations a cache feature books itself are its own (`take_slots`)."""
        loads, own = [], checked.own_allocations
        for seq_id, n in checked.plan.allocate.items():
            hit = checked.hits.get(seq_id)
            if own and seq_id in own:
                continue
            if hit is None:
                self.blocks.allocate(seq_id, n)
            else:
                loads += self.reuse.take_over(seq_id, hit, n)
        self.live.cols.num_blocks[checked.allocate_rows] += checked.allocate_counts
        return loads

    def decode_growth(self, rows: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """For `steps` more one-token decodes of `rows`: how many blocks each fills, and
        at which step (1-based) each row takes its first new one (then one every
        `block_tokens` steps). Step `j`
        computes position `num_computed + j - 1`."""
        cols, bs = self.live.cols, self.block_tokens(rows)
        first = cols.num_blocks[rows] * bs - cols.num_computed[rows] + 1
        return np.maximum(0, (steps - first) // bs + 1), first

    def grow_decodes(self, seq_ids: list[int], rows: np.ndarray, steps: int) -> None:
        """Allocate the blocks `steps` more one-token decodes fill, as that many plans
        would (`Plan.repeat`): step by step, in batch order within a step."""
        counts, first = self.decode_growth(rows, steps)
        total = int(counts.sum())
        if total > self.blocks.num_free:
            raise PlanError(f"{steps} repeated decode steps need {total} blocks, "
                            f"{self.blocks.num_free} free: the policy's repeat was wrong")
        if not total:
            return
        who = np.repeat(np.arange(len(rows)), counts)
        nth = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        bs = self.block_tokens(rows)
        step = first[who] + nth * (bs if np.isscalar(bs) else bs[who])
        for i in who[np.lexsort((who, step))].tolist():
            self.blocks.allocate(seq_ids[i], 1)
        self.live.cols.num_blocks[rows] += counts

    def _start_runs(self, checked: CheckedPlan, now: float) -> None:
        cols = self.live.cols
        cols.status[checked.run_rows] = RUNNING
        started = self.live.awaiting_run.intersection(checked.plan.run)
        for seq_id in started:
            metrics = self.live.requests[seq_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if metrics.last_preempted_at is not None:
                metrics.preempted_time += now - metrics.last_preempted_at
                metrics.last_preempted_at = None
        self.live.awaiting_run -= started
