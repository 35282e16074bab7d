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
from jserve.cache.layers import kept_layers, layer_shortfall
from jserve.cache.prefix import PrefixHit
from jserve.cache_features.protocol import CacheFeature, SectionCheck
from jserve.cache_features.registry import block_tokens, check_sections_known
from jserve.engine.layer_residency import LayerResidency
from jserve.engine.live_requests import LiveRequests
from jserve.engine.plan import Plan, PreemptMode
from jserve.engine.prefix_reuse import PrefixReuse
from jserve.engine.refusal import member, not_live, refuse_first, values
from jserve.engine.request import OFFLOADED, RUNNING, SWAPPED, WAITING
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
    layer_rows: np.ndarray  # rows of `plan.layers`' requests, in its order
    partial_allocations: frozenset[int]  # seq ids whose allocation is layer slots
    sections: tuple[SectionCheck, ...]  # each cache feature's, in the registry's order
    discarded: np.ndarray  # running requests a feature's section discards (recompute from 0)


_NO_ROWS = np.zeros(0, np.int64)
_NO_SEQS: frozenset[int] = frozenset()


@dataclass(frozen=True)
class LayerDemand:
    """What a plan's layer residency changes take (`_check_layers`): whole blocks beyond
    `fresh_blocks`' count, layer slots per layer on the device and the host, and the room
    their releases (done before any take) leave: blocks merged back to whole and free slots
    per layer, on each side."""

    whole: int
    device: np.ndarray
    host: np.ndarray
    merged: int
    free_slots: np.ndarray
    host_merged: int
    host_free_slots: np.ndarray
    partial_allocations: frozenset[int]


@dataclass(frozen=True)
class PlanChecker:
    live: LiveRequests
    blocks: BlockManager
    host_blocks: BlockManager | None
    limits: SchedulerLimits
    reuse: PrefixReuse | None
    residency: LayerResidency
    features: tuple[CacheFeature, ...] = ()

    def check(self, plan: Plan) -> CheckedPlan:
        """The plan with its rows, or `PlanError` for the first thing it gets wrong."""
        preempt_rows, to_host = self._check_preemptions(plan)
        self._check_swap_ins(plan)
        check_sections_known(plan, self.features)
        sections = tuple(feature.check(plan) for feature in self.features)
        switch_rows = np.concatenate([_NO_ROWS, *(c.discarded for c in sections)])
        if to_host and to_host > self.host_blocks.num_free:
            raise PlanError(f"plan swaps out {to_host} blocks, {self.host_blocks.num_free} free "
                            "on the host")
        discarded = list(plan.preempt)
        if len(switch_rows):
            discarded += self.live.cols.seq_id[switch_rows].tolist()
        released = self.blocks.released_by(discarded)
        hits = {} if self.reuse is None else self.reuse.admitted_hits(plan)
        self._check_evictions(plan, released, hits)
        allocate_rows, allocate_counts = self._check_allocations(plan, hits)
        layer_rows, layers = self._check_layers(plan)
        wanted = self.fresh_blocks(plan, hits) + (0 if layers is None else layers.whole)
        available = (self.blocks.num_free + self._uncached(released) + len(plan.evict)
                     + (0 if layers is None else layers.merged))
        if wanted > available:
            from_host = self._swapped_in_blocks(plan)
            swapping = f" ({from_host} of them to swap in)" if from_host else ""
            raise PlanError(f"plan allocates {wanted} blocks, {available} free" + swapping)
        if layers is not None:
            self._check_layer_room(layers, available - wanted, to_host)
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
                           run_rows, run_lens, reserve_rows, reserve_counts, layer_rows,
                           _NO_SEQS if layers is None else layers.partial_allocations,
                           sections, switch_rows)

    def _check_preemptions(self, plan: Plan) -> tuple[np.ndarray, int]:
        """Rows of the requests it preempts, and how many blocks go to the host."""
        if not plan.preempt:
            return _NO_ROWS, 0
        seq_ids, rows = list(plan.preempt), self.live.rows(plan.preempt)
        swap = np.fromiter((m is PreemptMode.SWAP for m in plan.preempt.values()), bool, len(rows))
        status = self.live.cols.status[rows]
        offloaded = status == OFFLOADED
        refuse_first(seq_ids, [
            not_live(seq_ids, rows, "preempt"),
            ((status != RUNNING) & ~offloaded,
             lambda i: f"seq {seq_ids[i]}: only running requests can be preempted"),
            (swap & (self.host_blocks is None),
             lambda i: f"seq {seq_ids[i]}: swap preemption needs a host KV tier (num_host_blocks > 0)"),
            (swap & offloaded,
             lambda i: f"seq {seq_ids[i]}: has layers on the host; preempt it by recompute, or "
                       "offload its other layers (Plan.layers)"),
        ])
        return rows, int(self.live.cols.num_blocks[rows[swap]].sum())

    def _check_swap_ins(self, plan: Plan) -> None:
        if not plan.swap_in:
            return
        seq_ids, rows = list(plan.swap_in), self.live.rows(plan.swap_in)
        refuse_first(seq_ids, [
            not_live(seq_ids, rows, "swap in"),
            (self.live.cols.status[rows] != SWAPPED,
             lambda i: f"seq {seq_ids[i]}: only swapped requests can be swapped in"),
        ])

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
            return _NO_ROWS, _NO_ROWS
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
            ((cols.status[rows] == SWAPPED) & ~member(seq_ids, plan.swap_in),
             lambda i: f"seq {seq_ids[i]}: is swapped out; swap it in before running it"),
            ((n < 1) | (end > total), lambda i: f"seq {seq_ids[i]}: cannot run {n[i]} tokens with "
                                                f"{computed[i]} of {total[i]} computed"),
            (held * bs < end, lambda i: f"seq {seq_ids[i]}: holds {held[i]} blocks, needs "
                                        f"{-(-int(end[i]) // int(np.broadcast_to(bs, end.shape)[i]))} "
                                        f"for {end[i]} tokens"),
        ])
        return rows, n

    def _check_layers(self, plan: Plan) -> tuple[np.ndarray, LayerDemand | None]:
        """Rows of `plan.layers`' requests and what the plan's residency changes take
        (None when it changes nothing and no request is partly offloaded)."""
        res = self.residency
        if not plan.layers and not res.partial:
            return _NO_ROWS, None
        L, cols = res.num_layers, self.live.cols
        seq_ids, rows, xs = list(plan.layers), self.live.rows(plan.layers), values(plan.layers)
        status = cols.status[rows]
        offload = xs < L
        refuse_first(seq_ids, [
            not_live(seq_ids, rows, "set the layers of"),
            ((xs < 0) | (xs > L), lambda i: f"seq {seq_ids[i]}: cannot keep {xs[i]} of {L} layers"),
            (member(seq_ids, plan.preempt),
             lambda i: f"seq {seq_ids[i]}: layers set and preempted in the same plan"),
            ((status == SWAPPED) | member(seq_ids, plan.swap_in),
             lambda i: f"seq {seq_ids[i]}: is swapped out; swap it in in an earlier plan before "
                       "setting its layers"),
            (offload & (self.reuse is not None),
             lambda i: f"seq {seq_ids[i]}: layer offload cannot share blocks with a prefix cache"),
            (offload & (self.host_blocks is None),
             lambda i: f"seq {seq_ids[i]}: layer offload needs a host KV tier (num_host_blocks > 0)"),
            (offload & (status == WAITING) & ~member(seq_ids, plan.run),
             lambda i: f"seq {seq_ids[i]}: a waiting request keeps fewer layers only in the plan "
                       "that prefills it"),
        ])
        partial = frozenset(s for s in set(plan.allocate).intersection(set(plan.layers) | set(res.partial))
                            if plan.layers.get(s, L if s not in res.partial else -1) < L)
        if not plan.layers and not partial:  # only decodes and releases of partial requests
            return rows, None
        device, host = np.zeros(L, np.int64), np.zeros(L, np.int64)
        whole = 0
        for seq_id, x, n in zip(seq_ids, xs.tolist(), cols.num_blocks[rows].tolist()):
            before, after = set(res.kept(seq_id)), set(kept_layers(L, x))
            if x == L:  # back to whole blocks (nothing for a fully resident request)
                whole += n if seq_id in res.partial else 0
                continue
            host[list(before - after)] += n
            device[list(after - before)] += n
        every = set(range(L))
        for seq_id in partial:
            x = plan.layers.get(seq_id, len(res.kept(seq_id)))
            kept, n = set(kept_layers(L, x)), plan.allocate[seq_id]
            whole -= n
            device[list(kept)] += n
            host[list(every - kept)] += n
        room = res.room_after_releases(plan.layers, set(plan.preempt).intersection(res.partial))
        return rows, LayerDemand(whole, device, host, *room, partial)

    def _check_layer_room(self, layers: LayerDemand, whole_left: int, to_host: int) -> None:
        """Slot takes come after every release and whole-block take, so layer `l` can give
        out its free slots plus the whole blocks left (`jserve.cache.layers`)."""
        short = layer_shortfall(layers.device, layers.free_slots, whole_left)
        if short:
            raise PlanError(f"plan takes {short} device layer slots more than a layer has free "
                            f"({whole_left} whole blocks left after its whole-block takes)")
        if self.residency.host_slab is None:
            return
        host_left = self.host_blocks.num_free - to_host + layers.host_merged
        short = layer_shortfall(layers.host, layers.host_free_slots, host_left)
        if short:
            raise PlanError(f"plan offloads {short} host layer slots more than a layer has free "
                            f"({host_left} whole host blocks left after its swap-outs)")

    def _check_repeat(self, plan: Plan, rows: np.ndarray, n: np.ndarray) -> None:
        """Only steps of plain decodes repeat (`Plan.repeat`)."""
        if plan.repeat < 1:
            raise PlanError(f"plan repeats {plan.repeat} times; at least once")
        if plan.preempt or plan.swap_in or plan.evict or plan.features or plan.layers:
            raise PlanError("a plan that preempts, swaps in, evicts, sets layers or has a cache "
                            "feature's section cannot repeat")
        partial = [s for s in plan.run if s in self.residency.partial]
        if partial:  # its growth is layer slots, and each step reads its host layers
            raise PlanError(f"seq {partial[0]}: has layers on the host; a repeated plan runs only "
                            "requests with every layer on the device")
        decoding = (n == 1) & (self.live.cols.num_tokens[rows] - self.live.cols.num_computed[rows] == 1)
        if not decoding.all():
            seq = list(plan.run)[int(np.argmin(decoding))]
            raise PlanError(f"seq {seq}: a repeated plan runs only one-token decodes")

    def fresh_blocks(self, plan: Plan, hits: dict[int, PrefixHit]) -> int:
        """Blocks the plan takes off the free list: its allocations less the cached blocks
        they take over, plus its swap-ins."""
        return (sum(plan.allocate.values()) - sum(len(h.device) for h in hits.values())
                + self._swapped_in_blocks(plan))

    def _swapped_in_blocks(self, plan: Plan) -> int:
        """Host blocks the plan brings back (a seq that is not live counts 0: `check`
        refuses the plan with the reason)."""
        if not plan.swap_in:
            return 0
        rows = self.live.rows(plan.swap_in)
        return int(self.live.cols.num_host_blocks[rows[rows >= 0]].sum())

    def _uncached(self, released: np.ndarray) -> int:
        return len(released) if self.reuse is None else self.reuse.uncached(released)

    def shortfall(self, plan: Plan, released: np.ndarray, hits: dict[int, PrefixHit]) -> int:
        """Blocks the plan needs beyond those free now or freed by its preemptions."""
        return self.fresh_blocks(plan, hits) - self.blocks.num_free - self._uncached(released)
