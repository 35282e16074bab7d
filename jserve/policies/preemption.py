"""The preemption rules several policies share, each written once: room for a decode is
made by preempting the latest arrivals (vLLM's FCFS priority), and a victim goes to the
host when it is to be swapped and the host has room, else is recomputed."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from jserve.cache_features.swap_tier.section import PreemptMode
from jserve.engine.view import SchedulerView


def swap_or_recompute(held: int, wants_swap: bool, host_free: int) -> tuple[PreemptMode, int]:
    """How a victim holding `held` device blocks is preempted, and the host blocks left:
    swapped if it `wants_swap` and the host has room for all of them, else recomputed."""
    if wants_swap and held <= host_free:
        return PreemptMode.SWAP, host_free - held
    return PreemptMode.RECOMPUTE, host_free


def make_room(view: SchedulerView, i: int, need: int, free: int, later: deque[int],
              preempt: Callable[[int], None]) -> tuple[bool, int]:
    """Room for running request `i` to take `need` more blocks of `free`: the latest
    arrivals of `later` (running requests that arrived after it, in arrival order) are
    preempted one by one until it fits; when even all of them do not make room, `i` itself
    is. Returns whether `i` keeps running, and the free blocks after the preemptions."""
    blocks = view.requests.num_blocks
    while need > free and later:
        victim = later.pop()
        preempt(victim)
        free += int(blocks[victim])
    if need > free:
        preempt(i)
        return False, free + int(blocks[i])
    return True, free
