"""Carrying out a checked plan, in the order `Plan` documents: preemptions release KV
(dropped, or moved to the host tier), evictions drop cached blocks, swap-ins bring KV
back, layer residency changes (LayerKV), allocations grow tables (a started request first
taking over its cached prefix), then the requests that run and the reservations are booked.

Layer residency changes release everything first (before the swap-ins), then every whole
block is taken (swap-ins, requests getting every layer back, allocations), then every
layer slot: the order `PlanChecker`'s exact counting assumes. A block a release frees (or
merges back to whole) may so serve a take of the same plan; runners read every source
before writing anything.

Nothing here checks anything: `PlanChecker` has, and a checked plan always applies.
What comes out is the block copies the runner must make before the step's compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jserve.cache.blocks import BlockManager
from jserve.cache_features.protocol import CacheFeature
from jserve.cache_features.registry import block_tokens
from jserve.engine.batch import BlockMove
from jserve.engine.layer_residency import LayerChange, LayerMoves, LayerResidency
from jserve.engine.live_requests import LiveRequests
from jserve.engine.plan import PreemptMode
from jserve.engine.plan_check import CheckedPlan
from jserve.engine.prefix_reuse import PrefixReuse
from jserve.engine.request import OFFLOADED, RUNNING, SWAPPED, WAITING
from jserve.errors import PlanError


@dataclass(frozen=True)
class Moves:
    """The copies an applied plan makes before its step's compute."""

    swap_out: tuple[BlockMove, ...] = ()
    swap_in: tuple[BlockMove, ...] = ()
    layers: LayerMoves | None = None  # None: no residency change


NO_MOVES = Moves()


@dataclass(frozen=True)
class PlanApplier:
    live: LiveRequests
    blocks: BlockManager
    host_blocks: BlockManager | None
    reuse: PrefixReuse | None
    residency: LayerResidency
    features: tuple[CacheFeature, ...] = ()

    def apply(self, checked: CheckedPlan, now: float) -> Moves:
        plan = checked.plan
        swap_out = self._preempt(checked, now)
        if plan.evict:
            swap_out += self.reuse.evict(sorted(plan.evict), checked.hits)
        for feature, section in zip(self.features, checked.sections):
            feature.release(section)
        changes = self._release_layers(checked) if plan.layers else []
        swap_in = self._swap_in(sorted(plan.swap_in))
        layer_moves = LayerMoves() if plan.layers else None
        L = self.residency.num_layers
        for change in changes:
            if change.x == L:
                self.residency.make_whole(change, layer_moves)
        swap_in += self._allocate(checked)
        for change in changes:
            if change.x < L:
                self.residency.take_for(change, layer_moves)
        for seq_id in checked.partial_allocations:  # in the layers the plan leaves them
            self.residency.allocate(seq_id, checked.plan.allocate[seq_id])
        self._start_runs(checked, now)
        self.live.cols.reserved_blocks[checked.reserve_rows] = checked.reserve_counts
        return Moves(tuple(swap_out), tuple(swap_in), layer_moves)

    def _preempt(self, checked: CheckedPlan, now: float) -> list[BlockMove]:
        cols, swap_out = self.live.cols, []
        for (seq_id, mode), row in zip(checked.plan.preempt.items(), checked.preempt_rows.tolist()):
            if self.residency.release(seq_id):  # partly offloaded: by recompute only
                cols.device_layers[row] = self.residency.num_layers
            held = np.asarray(self.blocks.table(seq_id), np.int32)
            self.blocks.free(seq_id)
            cols.num_blocks[row] = 0
            cols.reserved_blocks[row] = 0
            if mode is PreemptMode.SWAP:
                self.host_blocks.allocate(seq_id, len(held))
                cols.num_host_blocks[row] = len(held)
                cols.status[row] = SWAPPED
                swap_out.append(BlockMove(seq_id, held))
            else:
                cols.num_computed[row] = 0
                cols.status[row] = WAITING
            cols.num_preemptions[row] += 1
            metrics = self.live.requests[seq_id].metrics
            metrics.num_preemptions += 1
            metrics.last_preempted_at = now
            self.live.awaiting_run.add(seq_id)
        return swap_out

    def block_tokens(self, rows: np.ndarray) -> np.ndarray | int:
        """Tokens one block of each of `rows` holds (a cache feature's may differ)."""
        return block_tokens(self.features, self.blocks.block_size, rows)

    def _swap_in(self, seq_ids: list[int]) -> list[BlockMove]:
        cols, swap_in = self.live.cols, []
        for seq_id in seq_ids:
            row = self.live.row(seq_id)
            n = self.host_blocks.free(seq_id)
            self.blocks.allocate(seq_id, n)
            cols.num_host_blocks[row] = 0
            cols.num_blocks[row] = n
            cols.status[row] = RUNNING
            swap_in.append(BlockMove(seq_id, np.asarray(self.blocks.table(seq_id), np.int32)))
        return swap_in

    def _release_layers(self, checked: CheckedPlan) -> list[LayerChange]:
        """Residency changes' releases, before any whole-block take; their takes follow
        (`make_whole` with the whole-block takes, `take_for` with the slot takes)."""
        layers = checked.plan.layers
        changes = [self.residency.release_for(seq_id, x) for seq_id, x in layers.items()]
        self.live.cols.device_layers[checked.layer_rows] = np.fromiter(layers.values(), np.int16, len(layers))
        return [c for c in changes if c is not None]

    def _allocate(self, checked: CheckedPlan) -> list[BlockMove]:
        """Grow the tables by whole blocks; returns the copies that load host-tier cached
        blocks. Partly offloaded requests' layer slots are taken after the residency
        changes' (`apply`)."""
        loads, partial = [], checked.partial_allocations
        for seq_id, n in checked.plan.allocate.items():
            hit = checked.hits.get(seq_id)
            if partial and seq_id in partial:
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
        if checked.plan.layers or self.residency.partial:
            # the status follows the residency: a request with layers on the host stays
            # OFFLOADED while it runs (a decode reading them from the host), and one the
            # plan gives every layer back is RUNNING
            rows = np.concatenate([checked.run_rows, checked.layer_rows])
            partial = cols.device_layers[rows] < self.residency.num_layers
            cols.status[rows[partial]] = OFFLOADED
            cols.status[rows[~partial & (cols.status[rows] == OFFLOADED)]] = RUNNING
        started = self.live.awaiting_run.intersection(checked.plan.run)
        for seq_id in started:
            metrics = self.live.requests[seq_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if metrics.last_preempted_at is not None:
                metrics.preempted_time += now - metrics.last_preempted_at
                metrics.last_preempted_at = None
        self.live.awaiting_run -= started
