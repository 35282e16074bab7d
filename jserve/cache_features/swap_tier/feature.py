"""The engine's side of the swap tier: swap-outs checked and kept in the host tier as the
core preempts them, swap-ins taken back as whole device blocks, and the copies both make.
The host tier itself is the engine's (`StateParts.host_blocks`, shared with layer offload);
the runner's device-host block copies serve it and the prefix cache's host tier alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jserve.cache_features.protocol import NOTHING, CacheFeature, SectionCheck, StateParts
from jserve.cache_features.swap_tier.section import NAME, swaps
from jserve.engine.batch import BlockMove
from jserve.engine.plan import Plan
from jserve.engine.refusal import not_live, refuse_first
from jserve.engine.request import RUNNING, SWAPPED
from jserve.errors import PlanError


@dataclass
class SwapBooking:
    """A checked section, and the copies its booking makes (in plan order)."""

    out: frozenset[int]
    back: list[int]  # sorted: swap-ins take blocks in seq id order
    out_moves: list[BlockMove] = field(default_factory=list)
    in_moves: list[BlockMove] = field(default_factory=list)


class SwapTier(CacheFeature):
    """A swapped request is one whose table is in the host pool (layer offload lends that
    pool's blocks without tables), so the feature keeps no set of its own."""

    name = NAME

    def __init__(self, parts: StateParts) -> None:
        self.parts = parts

    def _is_swapped(self, seq_id: int) -> bool:
        host = self.parts.host_blocks
        return host is not None and host.num_held(seq_id) > 0

    @classmethod
    def build(cls, parts: StateParts, **_: object) -> SwapTier:
        return cls(parts)

    # ------------------------------------------------------------------ check
    def check(self, plan: Plan) -> SectionCheck:
        section = swaps(plan)
        host = self.parts.host_blocks
        if host is not None and host.num_table_blocks:
            stuck = [s for s in plan.run if host.num_held(s) and s not in section.back]
            if stuck:
                raise PlanError(f"seq {stuck[0]}: is swapped out; swap it in before running it")
        if not section.out and not section.back:
            return NOTHING
        strays = section.out.difference(plan.preempt)
        if strays:
            raise PlanError(f"seq {min(strays)}: swapped out, and the plan does not preempt it")
        out = [s for s in plan.preempt if s in section.out]
        to_host = self._check_out(out)
        back = sorted(section.back)
        cols, rows = self.parts.live.cols, self.parts.live.rows(back)
        refuse_first(back, [
            not_live(back, rows, "swap in"),
            (cols.status[rows] != SWAPPED, lambda i: f"seq {back[i]}: only swapped requests can be swapped in"),
        ])
        return SectionCheck(whole_taken=int(cols.num_host_blocks[rows].sum()), to_host=to_host,
                            claims=tuple(out), booking=SwapBooking(section.out, back))

    def _check_out(self, out: list[int]) -> int:
        """Host blocks the swap-outs take (the core has checked that each is a running
        request the plan preempts)."""
        if not out:
            return 0
        host, cols = self.parts.host_blocks, self.parts.live.cols
        rows = self.parts.live.rows(out)
        refuse_first(out, [
            (np.full(len(out), host is None),
             lambda i: f"seq {out[i]}: swap preemption needs a host KV tier (num_host_blocks > 0)"),
            (cols.status[rows] != RUNNING,
             lambda i: f"seq {out[i]}: has layers on the host; preempt it by recompute, or "
                       "offload its other layers"),
        ])
        to_host = int(cols.num_blocks[rows].sum())
        if to_host > host.num_free:
            raise PlanError(f"plan swaps out {to_host} blocks, {host.num_free} free on the host")
        return to_host

    def blocks_wanted(self, plan: Plan) -> int:
        back = swaps(plan).back
        if not back:
            return 0
        rows = self.parts.live.rows(back)
        return int(self.parts.live.cols.num_host_blocks[rows[rows >= 0]].sum())

    def holds_after(self, seq_ids: list[int], plan: Plan) -> np.ndarray:
        section = swaps(plan)
        return np.fromiter(((self._is_swapped(s) and s not in section.back) or s in section.out
                            for s in seq_ids), bool, len(seq_ids))

    # ------------------------------------------------------------------ apply

    def keep(self, checked: SectionCheck, seq_id: int, row: int, held: np.ndarray) -> bool:
        booking: SwapBooking | None = checked.booking
        if booking is None or seq_id not in booking.out:
            return False
        cols = self.parts.live.cols
        self.parts.host_blocks.allocate(seq_id, len(held))
        cols.num_host_blocks[row] = len(held)
        cols.status[row] = SWAPPED
        booking.out_moves.append(BlockMove(seq_id, held))
        return True

    def take_whole(self, checked: SectionCheck) -> None:
        booking: SwapBooking | None = checked.booking
        if booking is None:
            return
        live, blocks = self.parts.live, self.parts.blocks
        for seq_id in booking.back:
            row = live.row(seq_id)
            n = self.parts.host_blocks.free(seq_id)
            blocks.allocate(seq_id, n)
            live.cols.num_host_blocks[row] = 0
            live.cols.num_blocks[row] = n
            live.cols.status[row] = RUNNING
            booking.in_moves.append(BlockMove(seq_id, np.asarray(blocks.table(seq_id), np.int32)))

    def moves(self, checked: SectionCheck) -> tuple[Sequence[BlockMove], Sequence[BlockMove]]:
        booking: SwapBooking | None = checked.booking
        return ((), ()) if booking is None else (booking.out_moves, booking.in_moves)

    # ------------------------------------------------------------------ between steps
    def check_invariants(self, prefix_cache: bool) -> None:
        """Swapped exactly while its table is in the host pool (the core checks that no
        other status holds host blocks)."""
        live = self.parts.live
        rows = live.live_rows()
        swapped = rows[live.cols.status[rows] == SWAPPED]
        assert (live.cols.num_host_blocks[swapped] > 0).all(), "a swapped request holds no host blocks"
