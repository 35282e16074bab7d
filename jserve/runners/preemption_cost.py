"""Fitting CacheOpt's preemption latency curves (`jserve.engine.preemption_costs`) to a
runner's profile: recompute as a prefill of the cached tokens, swap as their K/V over the
host link, out and back in.

The fit is by least squares: for each exponent `b` on a grid the rest of `L_r` is linear in
(a, k, e), so the best b is found by scanning; `L_s` is a line.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jserve.engine.preemption_costs import PreemptionCosts
from jserve.runners.cost_model import CostModel, recompute_time

DEFAULT_SIZES = (16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)


def fit_preemption_costs(sizes: Sequence[int], recompute_s: Sequence[float],
                         swap_s: Sequence[float]) -> PreemptionCosts:
    """Least-squares fit to measured (size, recompute seconds, swap seconds) samples."""
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
    return PreemptionCosts(float(a), float(b), float(k), float(e), float(max(g, 0.0)),
                           float(max(d, 0.0)))


def preemption_costs_from_cost_model(cost: CostModel, kv_bytes_per_token: float,
                                     host_bytes_per_s: float,
                                     sizes: Sequence[int] = DEFAULT_SIZES) -> PreemptionCosts:
    """Fit to a cost model's prefill times and host-link transfers (out and back in)."""
    recompute = [recompute_time(cost, n) for n in sizes]
    swap = [2 * n * kv_bytes_per_token / host_bytes_per_s for n in sizes]
    return fit_preemption_costs(sizes, recompute, swap)
