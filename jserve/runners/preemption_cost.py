"""Fitting CacheOpt's preemption latency curves (`jserve.engine.preemption_costs`) to a
profile, as the paper's Section 3.5 does: time recompute and swap over a range of sequence
lengths, fit `L_r(S) = a*S**b + k*S + e` and `L_s(S) = g*S + d` (a line), and solve
`L_r = L_s` for the sweet spot.

Section 3.5 writes the recompute regressor with a fitted exponent `b` (its beta_r), while
Section 2.5 says recompute grows quadratically (O(s^2), Figure 8). We read it as the
quadratic, `b = 2` by default: a fitted exponent over a profile that attention does not yet
dominate comes out near 1 and then extrapolates the crossing badly. `exponent=None` scans b.

The profile comes from a cost model (`profile_cost_model`: recompute = the step time of a
prefill of S tokens, swap = the steps' wait for S tokens' blocks out and back in, priced by
the model's `SwapPath`) or from the real runner (`jserve.runners.profiling.measure_preemption`).

Both fits are plain (unweighted) non-negative least squares: no term may make a latency
fall with S. Unweighted, the long sequences set the fit, and with them the curves' slopes
that decide where they cross; weighting by 1/latency was tried and, on the cost model's
OPT-13B profile (a memory-bound floor, then linear), bent the quadratic enough to put a
crossing at 1.3k tokens where swap is faster at every profiled length.
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
