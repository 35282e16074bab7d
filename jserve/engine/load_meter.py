"""The load a policy sees in its view: how fast requests arrive and how long steps take.

CacheOpt lowers its padding confidence as the arrival rate rises and treats a request as
critical when its slack is within one (recent, longest) iteration of its SLO; both need
these measured on the engine's own clock, virtual or wall.
"""

from __future__ import annotations

import collections
import itertools


class LoadMeter:
    ARRIVAL_WINDOW = 30.0  # seconds over which `arrival_rate` is measured

    def __init__(self) -> None:
        # Arrival times inside the rate window (older ones are dropped as time passes).
        self._arrivals: collections.deque[float] = collections.deque()
        self._first_arrival: float | None = None
        self._step_times: collections.deque[float] = collections.deque(maxlen=16)

    def record_arrival(self, t: float) -> None:
        self._arrivals.append(t)
        if self._first_arrival is None:
            self._first_arrival = t

    def record_step(self, seconds: float) -> None:
        self._step_times.append(seconds)

    @property
    def iteration_time(self) -> float:
        """The longest of the last 16 steps, seconds (0 before the first)."""
        return max(self._step_times, default=0.0)

    def arrival_rate(self, now: float) -> float:
        """Requests per second that arrived in the last `ARRIVAL_WINDOW` seconds (or since
        the first arrival, if that is more recent)."""
        if self._first_arrival is None:
            return 0.0
        window_start = now - self.ARRIVAL_WINDOW
        while self._arrivals and self._arrivals[0] <= window_start:  # out of every later window
            self._arrivals.popleft()
        start = max(window_start, self._first_arrival)
        n = len(self._arrivals) - sum(1 for _ in itertools.takewhile(lambda t: t <= start, self._arrivals))
        return n / max(now - start, 1e-9) if n else 0.0
