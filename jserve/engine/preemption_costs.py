"""What preempting a request costs, as numbers a policy can read (CacheOpt's swap-vs-recompute
choice).

A policy must not know how time is measured or simulated, so the fitted latency curves reach
it as data: `jserve.runners.preemption_cost` fits them to a profile of the runner in use and
the builder (`jserve.builder`) hands them to the policy.

Recompute is modelled as `L_r(S) = a * S**b + k * S + e` (a prefill of the S cached tokens:
attention grows superlinearly, the projections linearly, plus a fixed step cost) and swap as
`L_s(S) = g * S + d` (S tokens' K/V over the host link, out and back in). For small S
recompute is cheaper; past the sweet spot S*, where the curves cross, swapping is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreemptionCosts:
    """The fitted coefficients of `L_r` (a, b, k, e) and `L_s` (g, d), in seconds."""

    a: float
    b: float
    k: float
    e: float
    g: float
    d: float

    def recompute(self, tokens: float) -> float:
        return self.a * tokens**self.b + self.k * tokens + self.e

    def swap(self, tokens: float) -> float:
        return self.g * tokens + self.d

    def prefers_swap(self, tokens: int) -> bool:
        return self.swap(tokens) < self.recompute(tokens)

    def sweet_spot(self, limit: int = 1 << 20) -> int:
        """Smallest token count at which swapping is faster (`limit` if it never is below it);
        the curves cross once for the fitted shapes, so bisection suffices."""
        if self.prefers_swap(1):
            return 1
        if not self.prefers_swap(limit):
            return limit
        lo, hi = 1, limit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.prefers_swap(mid) else (mid, hi)
        return hi
