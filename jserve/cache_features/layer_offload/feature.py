"""The engine's side of layer residency: its plan section checked against the state (the
rules, and exact room per layer) and booked in the plan's order, and what must hold of
partly offloaded requests. A plan's residency changes release everything first (before the
swap-ins), then every whole block is taken (swap-ins, requests getting every layer back,
allocations), then every layer slot: so layer `l` can give out its free slots plus the
whole blocks left, which makes the count exact."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from jserve.cache.layers import kept_layers, layer_shortfall
from jserve.cache_features.layer_offload.batch import LayerBatch, LayerMove, LayerTraffic
from jserve.cache_features.layer_offload.residency import LayerChange, LayerMoves, LayerResidency
from jserve.cache_features.layer_offload.section import COLUMN, NAME, LayerView, kept
from jserve.cache_features.protocol import NOTHING, CacheFeature, Runs, SectionCheck, StateParts
from jserve.engine.plan import Plan
from jserve.engine.refusal import member, not_live, refuse_first, values
from jserve.engine.request import OFFLOADED, RUNNING, SWAPPED, WAITING
from jserve.errors import PlanError


@dataclass(frozen=True)
class LayerDemand:
    """What a plan's residency changes take: whole blocks beyond the plan's allocations,
    layer slots per layer on the device and the host, and the room their releases (done
    before any take) leave: blocks merged back to whole and free slots per layer, on each
    side."""

    whole: int
    device: np.ndarray
    host: np.ndarray
    merged: int
    free_slots: np.ndarray
    host_merged: int
    host_free_slots: np.ndarray


@dataclass
class LayerBooking:
    """A checked section and, once released, its changes and the copies they make."""

    rows: np.ndarray  # rows of the section's requests, in its order
    layers: Mapping[int, int]
    allocations: dict[int, int]  # partly offloaded requests' allocations, in layer slots
    demand: LayerDemand | None
    changes: list[LayerChange] = field(default_factory=list)
    moves: LayerMoves | None = None


class LayerOffload(CacheFeature):
    name = NAME

    def __init__(self, parts: StateParts, num_layers: int) -> None:
        self.parts = parts
        self.residency = LayerResidency(parts.blocks, parts.host_blocks, num_layers)
        parts.live.table.add_column(COLUMN, np.int16, num_layers)

    @classmethod
    def build(cls, parts: StateParts, *, num_layers: int = 1, **_: object) -> LayerOffload:
        return cls(parts, num_layers)

    def _layers(self) -> np.ndarray:
        """Every table row's count of layers kept on the device."""
        return self.parts.live.table.columns[COLUMN]

    def view_section(self, rows: np.ndarray) -> LayerView:
        res = self.residency
        return LayerView(res.num_layers, res.free_slots(), res.free_host_slots(), self._layers().take(rows))

    # ------------------------------------------------------------------ check
    def check(self, plan: Plan) -> SectionCheck:
        layers, res = kept(plan), self.residency
        if not layers and not res.partial:
            return NOTHING
        if plan.repeat != 1:
            self._check_repeat(plan)
        L, cols = res.num_layers, self.parts.live.cols
        seq_ids, rows, xs = list(layers), self.parts.live.rows(layers), values(layers)
        status = cols.status[rows]
        offload = xs < L
        refuse_first(seq_ids, [
            not_live(seq_ids, rows, "set the layers of"),
            ((xs < 0) | (xs > L), lambda i: f"seq {seq_ids[i]}: cannot keep {xs[i]} of {L} layers"),
            (member(seq_ids, plan.preempt),
             lambda i: f"seq {seq_ids[i]}: layers set and preempted in the same plan"),
            (status == SWAPPED,
             lambda i: f"seq {seq_ids[i]}: is swapped out; swap it in in an earlier plan before "
                       "setting its layers"),
            (offload & (self.parts.reuse is not None),
             lambda i: f"seq {seq_ids[i]}: layer offload cannot share blocks with a prefix cache"),
            (offload & (self.parts.host_blocks is None),
             lambda i: f"seq {seq_ids[i]}: layer offload needs a host KV tier (num_host_blocks > 0)"),
            (offload & (status == WAITING) & ~member(seq_ids, plan.run),
             lambda i: f"seq {seq_ids[i]}: a waiting request keeps fewer layers only in the plan "
                       "that prefills it"),
        ])
        partial = {s: n for s, n in plan.allocate.items()
                   if layers.get(s, L if s not in res.partial else -1) < L}
        demand = self._demand(plan, layers, partial) if layers or partial else None
        claims = tuple(s for s, x in layers.items() if x < L)
        booking = LayerBooking(rows, layers, partial, demand)
        if demand is None:
            return SectionCheck(claims=claims, booking=booking)
        return SectionCheck(whole_taken=demand.whole, whole_freed=demand.merged,
                            own_allocations=frozenset(partial), claims=claims, booking=booking)

    def _check_repeat(self, plan: Plan) -> None:
        partial = [s for s in plan.run if s in self.residency.partial]
        if partial:  # its growth is layer slots, and each step reads its host layers
            raise PlanError(f"seq {partial[0]}: has layers on the host; a repeated plan runs only "
                            "requests with every layer on the device")

    def _demand(self, plan: Plan, layers: Mapping[int, int], partial: Mapping[int, int]) -> LayerDemand:
        res, cols = self.residency, self.parts.live.cols
        L = res.num_layers
        device, host = np.zeros(L, np.int64), np.zeros(L, np.int64)
        whole = 0
        held = cols.num_blocks[self.parts.live.rows(layers)].tolist()
        for seq_id, x, n in zip(layers, layers.values(), held):
            before, after = set(res.kept(seq_id)), set(kept_layers(L, x))
            if x == L:  # back to whole blocks (nothing for a fully resident request)
                whole += n if seq_id in res.partial else 0
                continue
            host[list(before - after)] += n
            device[list(after - before)] += n
        every = set(range(L))
        for seq_id, n in partial.items():
            keep = set(kept_layers(L, layers.get(seq_id, len(res.kept(seq_id)))))
            whole -= n
            device[list(keep)] += n
            host[list(every - keep)] += n
        room = res.room_after_releases(layers, set(plan.preempt).intersection(res.partial))
        return LayerDemand(whole, device, host, *room)

    def check_room(self, checked: SectionCheck, whole_left: int, to_host: int) -> None:
        demand = None if checked.booking is None else checked.booking.demand
        if demand is None:
            return
        short = layer_shortfall(demand.device, demand.free_slots, whole_left)
        if short:
            raise PlanError(f"plan takes {short} device layer slots more than a layer has free "
                            f"({whole_left} whole blocks left after its whole-block takes)")
        if self.residency.host_slab is None:
            return
        host_left = self.parts.host_blocks.num_free - to_host + demand.host_merged
        short = layer_shortfall(demand.host, demand.host_free_slots, host_left)
        if short:
            raise PlanError(f"plan offloads {short} host layer slots more than a layer has free "
                            f"({host_left} whole host blocks left after its swap-outs)")

    def holds_after(self, seq_ids: list[int], plan: Plan) -> np.ndarray:
        res, layers = self.residency, kept(plan)
        L = res.num_layers
        return np.fromiter((layers.get(s, L if s in plan.preempt else len(res.kept(s))) < L
                            for s in seq_ids), bool, len(seq_ids))

    # ------------------------------------------------------------------ apply
    def drop(self, seq_id: int, row: int) -> None:
        if self.residency.release(seq_id):  # partly offloaded: preempted by recompute, or ended
            self._layers()[row] = self.residency.num_layers

    def release(self, checked: SectionCheck) -> None:
        """Residency changes' releases, before any whole-block take."""
        booking: LayerBooking | None = checked.booking
        if booking is None or not booking.layers:
            return
        changes = [self.residency.release_for(s, x) for s, x in booking.layers.items()]
        self._layers()[booking.rows] = np.fromiter(
            booking.layers.values(), np.int16, len(booking.layers))
        booking.changes = [c for c in changes if c is not None]
        booking.moves = LayerMoves()

    def take_whole(self, checked: SectionCheck) -> None:
        booking: LayerBooking | None = checked.booking
        if booking is None:
            return
        for change in booking.changes:
            if change.x == self.residency.num_layers:
                self.residency.make_whole(change, booking.moves)

    def take_slots(self, checked: SectionCheck) -> None:
        booking: LayerBooking | None = checked.booking
        if booking is None:
            return
        for change in booking.changes:
            if change.x < self.residency.num_layers:
                self.residency.take_for(change, booking.moves)
        for seq_id, n in booking.allocations.items():  # in the layers the plan leaves them
            self.residency.allocate(seq_id, n)

    def after_runs(self, checked: SectionCheck, run_rows: np.ndarray) -> None:
        """A request with layers on the host stays OFFLOADED while it runs (a decode
        reading them from the host); one the plan gives every layer back is RUNNING."""
        booking: LayerBooking | None = checked.booking
        if booking is None:
            return
        cols = self.parts.live.cols
        rows = np.concatenate([run_rows, booking.rows])
        partial = self._layers()[rows] < self.residency.num_layers
        cols.status[rows[partial]] = OFFLOADED
        cols.status[rows[~partial & (cols.status[rows] == OFFLOADED)]] = RUNNING

    # ------------------------------------------------------------------ the runner's work
    def batch_section(self, checked: SectionCheck, runs: Runs, with_inputs: bool) -> LayerBatch | None:
        """The booking's copies and the partly offloaded runs' tables (a real runner's
        batch), with the traffic of both; None when the plan changed no residency and no
        partly offloaded request runs."""
        booking: LayerBooking | None = checked.booking
        moves = None if booking is None else booking.moves
        partial = self._partial_runs(runs.seq_ids)
        if moves is None and not partial:
            return None
        moves = moves or LayerMoves()
        tables = {i: self.residency.tables(s) for i, s in partial.items()} if with_inputs else {}
        return LayerBatch(tuple(moves.to_host), tuple(moves.to_device), tuple(moves.device_copies),
                          tables, self._traffic(moves, partial, runs))

    def _partial_runs(self, seq_ids: np.ndarray) -> dict[int, int]:
        """Batch index -> seq id of the sequences that run with layers on the host."""
        partial = self.residency.partial
        if not partial:
            return {}
        found = np.flatnonzero(np.isin(seq_ids, np.fromiter(partial, np.int64, len(partial))))
        return dict(zip(found.tolist(), seq_ids[found].tolist()))

    def _traffic(self, moves: LayerMoves, partial: dict[int, int], runs: Runs) -> LayerTraffic:
        """Layer blocks moved per layer. A partly offloaded request that runs reads each host
        layer's blocks holding its context (the blocks before `start`, the last partly filled
        one included) to the device for the step, and writes the blocks its new tokens fill
        back to the host (a prefill: every block)."""
        L, bs = self.residency.num_layers, self.parts.blocks.block_size

        def per_layer(moved: list[LayerMove]) -> np.ndarray:
            out = np.zeros(L, np.int64)
            for m in moved:
                out[m.layer] += len(m.src)
            return out

        written, read = np.zeros(L, np.int64), np.zeros(L, np.int64)
        for i, seq_id in partial.items():
            host = list(self.residency.partial[seq_id].host)
            s, end = int(runs.start[i]), int(runs.start[i] + runs.query_lens[i])
            read[host] += -(-s // bs)
            written[host] += -(-end // bs) - s // bs
        moved = (written, per_layer(moves.to_host), per_layer(moves.to_device) + read,
                 per_layer(moves.device_copies))
        return LayerTraffic(*(tuple(m.tolist()) for m in moved))

    # ------------------------------------------------------------------ between steps
    def own_blocks(self) -> Collection[int]:
        return self.residency.partial.keys()

    def check_invariants(self, prefix_cache: bool) -> None:
        """Each slot held once per layer (`LayerResidency`); a request is OFFLOADED exactly
        when it keeps fewer than every layer, its columns matching its slots."""
        live, res, cols = self.parts.live, self.residency, self.parts.live.cols
        res.check_invariants(set(live.requests))
        L, rows = res.num_layers, live.live_rows()
        partial = np.isin(cols.seq_id[rows], np.fromiter(res.partial, np.int64, len(res.partial)))
        assert ((self._layers()[rows] == L) == ~partial).all(), "device_layers != residency"
        assert ((cols.status[rows] == OFFLOADED) == partial).all(), "OFFLOADED != partly offloaded"
        host_blocks = self.parts.host_blocks
        for row in rows[partial].tolist():
            seq_id = int(cols.seq_id[row])
            part = res.partial[seq_id]
            assert part.kept == kept_layers(L, int(self._layers()[row]))
            assert int(cols.num_blocks[row]) == part.num_blocks, f"seq {seq_id} layer blocks"
            # 0 between the plan that prefills it keeping some layers and that step's commit
            assert 0 <= int(cols.num_computed[row]) <= part.num_blocks * self.parts.blocks.block_size
            assert int(cols.num_host_blocks[row]) == 0 and host_blocks.num_held(seq_id) == 0

