"""Fitting CacheOpt's preemption latency curves (`jserve.engine.preemption_costs`) to a profile
of a cost model or of the real runner, as the paper's Section 3.5 does, and solving for the
sweet spot where they cross. Why the recompute curve is quadratic and the fits unweighted, with
what the alternatives gave: docs/policies.md, CacheOpt's preemption costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jserve.engine.preemption_costs import PreemptionCosts
from jserve.runners.cost_model import CostModel, nnls, recompute_time, swap_time

# Sequence lengths profiled by default: up to 4,096, past the paper's Figure 8 sweet spot.
DEFAULT_SIZES = (16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)


@dataclass(frozen=True)
class PreemptionProfile:
    """Measured or modelled latencies (seconds) of recomputing and of swapping (out and in)
    a request of each length in `sizes`."""

    sizes: tuple[int, ...]
    recompute_s: tuple[float, ...]
    swap_s: tuple[float, ...]

    def fit(self) -> PreemptionCosts:
        return fit_preemption_costs(self.sizes, self.recompute_s, self.swap_s)

    def to_dict(self) -> dict[str, list[float]]:
        return {"sizes": list(self.sizes), "recompute_s": list(self.recompute_s),
                "swap_s": list(self.swap_s)}


def fit_preemption_costs(sizes: Sequence[int], recompute_s: Sequence[float],
                         swap_s: Sequence[float], exponent: float | None = 2.0) -> PreemptionCosts:
    """Fit to (size, recompute seconds, swap seconds) samples; `exponent`: b of `L_r`
    (None: the best of a grid over [1, 2.5])."""
    s = np.asarray(sizes, np.float64)
    r = np.asarray(recompute_s, np.float64)
    w = np.asarray(swap_s, np.float64)
    if len(s) < 4 or len(r) != len(s) or len(w) != len(s):
        raise ValueError("need at least 4 (size, recompute time, swap time) samples")
    if (r <= 0).any() or (w <= 0).any():
        raise ValueError("latencies must be > 0")

    def fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
        coef = nnls(x, y)
        return coef, float(((x @ coef - y) ** 2).sum())

    grid = np.linspace(1.0, 2.5, 61) if exponent is None else [exponent]
    fits = [(fit(np.stack([s**b, s, np.ones_like(s)], 1), r), b) for b in grid]
    ((a, k, e), _), b = min(fits, key=lambda f: f[0][1])
    g, d = fit(np.stack([s, np.ones_like(s)], 1), w)[0]
    return PreemptionCosts(float(a), float(b), float(k), float(e), float(g), float(d))


def profile_cost_model(cost: CostModel, block_size: int, bytes_per_block: int,
                       sizes: Sequence[int] = DEFAULT_SIZES) -> PreemptionProfile:
    """A cost model's latencies: a prefill of S tokens, and S tokens' blocks out and in."""
    return PreemptionProfile(
        tuple(sizes), tuple(recompute_time(cost, n) for n in sizes),
        tuple(swap_time(cost, n, block_size, bytes_per_block) for n in sizes))


def preemption_costs_from_cost_model(cost: CostModel, block_size: int, bytes_per_block: int,
                                     sizes: Sequence[int] = DEFAULT_SIZES) -> PreemptionCosts:
    """The curves fitted to a cost model's profile (what the builder hands CacheOpt)."""
    return profile_cost_model(cost, block_size, bytes_per_block, sizes).fit()
