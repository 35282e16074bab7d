"""Clocks for the engine loop: wall time on the real engine, virtual time in the simulator."""

from __future__ import annotations

import time


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, t: float) -> None:
        """Idle until `t` (an arrival in the future)."""
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class VirtualClock:
    """Time that moves only when the simulator charges a step or skips idle time."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go back ({seconds} s)")
        self._now += seconds

    def wait_until(self, t: float) -> None:
        self._now = max(self._now, t)
