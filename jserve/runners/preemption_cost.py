"""Latency of preempting a request of S cached tokens by recompute or by swap, fitted to a
runner's profile, and the sweet spot between them (CacheOpt's preemption strategy).

CacheOpt models recompute as `L_r(S) = a * S**b + k * S + e` (a prefill: attention grows
superlinearly, the projections linearly, plus a fixed step cost) and swap as
`L_s(S) = g * S + d` (a transfer of S tokens' K/V over PCIe, twice: out and back in). For
small S recompute is cheaper (one short prefill beats two transfers' latency); past the
sweet spot S*, where the curves cross, swapping is. The fit is by least squares: for each
exponent `b` on a grid the rest is linear in (a, k, e), so the best b is found by scanning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jserve.runners.cost_model import CostModel, recompute_time

DEFAULT_SIZES = (16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)


@dataclass(frozen=True)
class PreemptionCosts:
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

    @classmethod
    def fit(cls, sizes: Sequence[int], recompute_s: Sequence[float], swap_s: Sequence[float]
            ) -> PreemptionCosts:
        s = np.asarray(sizes, np.float64)
        r = np.asarray(recompute_s, np.float64)
        if len(s) < 4 or len(r) != len(s) or len(swap_s) != len(s):
            raise ValueError("need at least 4 (size, recompute time, swap time) samples")
        best = None
        for b in np.linspace(1.0, 2.5, 61):
            x = np.stack([s**b, s, np.ones_like(s)], axis=1)
            coef, *_ = np.linalg.lstsq(x, r, rcond=None)
            coef = np.maximum(coef, 0.0)  # times grow with S: no negative terms
            err = float(((x @ coef - r) ** 2).sum())
            if best is None or err < best[0]:
                best = (err, b, coef)
        _, b, (a, k, e) = best
        g, d = np.polyfit(s, np.asarray(swap_s, np.float64), 1)
        return cls(float(a), float(b), float(k), float(e), float(max(g, 0.0)), float(max(d, 0.0)))

    @classmethod
    def from_cost_model(cls, cost: CostModel, kv_bytes_per_token: float, pcie_bytes_per_s: float,
                        sizes: Sequence[int] = DEFAULT_SIZES) -> PreemptionCosts:
        """Fit to a cost model's prefill times and PCIe transfers (out and back in)."""
        recompute = [recompute_time(cost, n) for n in sizes]
        swap = [2 * n * kv_bytes_per_token / pcie_bytes_per_s for n in sizes]
        return cls.fit(sizes, recompute, swap)
