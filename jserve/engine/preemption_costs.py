"""What preempting a request costs, as numbers a policy can read (CacheOpt's swap-vs-recompute
choice, Section 3.5 of the paper): fitted recompute and swap curves and the sweet spot where
they cross, handed over by the builder so that a policy never knows how time is measured. The
curves' forms and why the sweet spot is the upper root: docs/policies.md, CacheOpt.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

SWEET_SPOT_LIMIT = 1 << 20  # longest sequence the solve considers (beyond any model's context)


@dataclass(frozen=True)
class SweetSpot:
    """The solved threshold. `tokens`: the smallest integer length from which swapping is
    faster at every length up to the limit (`crossing`); 0 when it is faster at every
    length (`always`); the limit when it is not faster even there (`never`)."""

    kind: Literal["crossing", "always", "never"]
    tokens: int

    def describe(self) -> str:
        return {"crossing": f"{self.tokens} tokens", "always": "always swap (no crossing)",
                "never": f"never swap (recompute wins up to {self.tokens} tokens)"}[self.kind]


@dataclass(frozen=True)
class PreemptionCosts:
    """The fitted coefficients of `L_r` (a, b, k, e) and `L_s` (g, d), in seconds."""

    a: float
    b: float
    k: float
    e: float
    g: float
    d: float

    def __post_init__(self) -> None:
        if self.b < 1 or self.a < 0:
            raise ValueError(f"L_r needs a >= 0 and b >= 1 (a convex recompute curve), got a={self.a}, b={self.b}")

    def recompute(self, tokens: float) -> float:
        return self.a * tokens**self.b + self.k * tokens + self.e

    def swap(self, tokens: float) -> float:
        return self.g * tokens + self.d

    def prefers_swap(self, tokens: int) -> bool:
        return self.swap(tokens) < self.recompute(tokens)

    def solve(self, limit: int = SWEET_SPOT_LIMIT) -> SweetSpot:
        """The sweet spot as data (cached: the policy asks at every preemption)."""
        return _solve(self, limit)

    def sweet_spot(self, limit: int = SWEET_SPOT_LIMIT) -> int:
        """The policy-facing threshold: swap a request of S cached tokens iff S >= this.
        0 when swapping always wins, `limit` when it never does (see `SweetSpot`)."""
        return self.solve(limit).tokens


def _argmin_gap(c: PreemptionCosts, limit: int) -> float:
    """Where the convex gap `L_r - L_s` is smallest on [1, limit]."""
    slope = c.k - c.g  # the gap's derivative is a*b*S**(b-1) + slope
    if c.a > 0 and c.b > 1:
        s = (-slope / (c.a * c.b)) ** (1.0 / (c.b - 1.0)) if slope < 0 else 1.0
    else:
        s = limit if c.a + slope < 0 else 1.0
    return min(max(s, 1.0), float(limit))


@functools.lru_cache(maxsize=64)
def _solve(c: PreemptionCosts, limit: int) -> SweetSpot:
    if not c.prefers_swap(limit):
        return SweetSpot("never", limit)
    m = int(_argmin_gap(c, limit))  # the integer minimum of the convex gap is m or m + 1
    near = [s for s in (m, m + 1) if s <= limit]
    losing = [s for s in near if not c.prefers_swap(s)]
    if not losing:
        return SweetSpot("always", 0)
    # Recompute wins at `lo`, at or next to the gap's minimum, and swap at `limit`; past the
    # minimum the gap only grows, so the lengths where swap wins above `lo` are one interval.
    lo, hi = losing[0], limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if c.prefers_swap(mid) else (mid, hi)
    return SweetSpot("crossing", hi)
