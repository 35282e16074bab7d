"""Apt-Serve's hybrid-cache scheduling problem (Section 5, Eqs. 7-10, and its appendix's greedy)
as a pure numpy function over candidate columns: items by marginal gain per block until the
first that does not fit, against the best single schedule (a 2-approximation). The appendix's
gaps closed here and our off-by-default readings: docs/policies.md, Apt-Serve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NONE, KV, HIDDEN = -1, 0, 1  # choice per candidate; KV / HIDDEN match `CacheType`


@dataclass(frozen=True)
class Candidates:
    """Columns of the requests one scheduling problem chooses from, aligned."""

    value: np.ndarray  # p_i, seconds (after the SLO-aware fallback)
    kv_blocks: np.ndarray  # blocks of the whole cache on the KV type (m_i)
    hidden_blocks: np.ndarray  # on the hidden type; >= kv_blocks: no hidden option
    tokens: np.ndarray  # batched tokens it computes if chosen

    def __len__(self) -> int:
        return len(self.value)


@dataclass(frozen=True)
class Bounds:
    blocks: int
    tokens: int
    seqs: int


@dataclass(frozen=True)
class GreedyRules:
    """How the greedy reads two points the appendix settles one way (both False: its way)."""

    skip: bool = False  # pass over an item that does not fit instead of stopping there
    hidden_fallback: bool = False  # offer the hidden half where the refinement says KV but KV cannot fit


def schedule_values(c: Candidates, choice: np.ndarray, penalty: float) -> float:
    """Sum of the chosen schedules' values (the objective of Definition 1)."""
    kv, hid = choice == KV, choice == HIDDEN
    return float(c.value[kv].sum() + (c.value[hid] - penalty * c.hidden_blocks[hid]).sum())


def refined_to_kv(c: Candidates, penalty: float) -> np.ndarray:
    """The paper's refinement: requests whose hidden half gains less per block than their KV
    cache taken whole, which it keeps off the hidden cache."""
    k, h = c.kv_blocks.astype(np.float64), c.hidden_blocks.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (c.value - penalty * h) / np.maximum(h, 1) < c.value / np.maximum(k, 1)


def greedy_types(c: Candidates, bounds: Bounds, penalty: float, hidden: bool = True,
                 rules: GreedyRules = GreedyRules()) -> np.ndarray:
    """Which candidates run and on which cache type (NONE / KV / HIDDEN per candidate).

    `penalty` is (|W| + |R|) * rho, seconds per hidden block; `hidden=False` offers the KV
    cache only (the paper's Table 4 ablation)."""
    n = len(c)
    choice = np.full(n, NONE, np.int8)
    if n == 0:
        return choice
    k = c.kv_blocks.astype(np.float64)
    h = c.hidden_blocks.astype(np.float64)
    v = c.value.astype(np.float64)
    hidden_value = v - penalty * h
    fits_tokens = (c.tokens <= bounds.tokens) & (bounds.seqs >= 1)
    can_kv = fits_tokens & (k <= bounds.blocks)
    can_hid = fits_tokens & (h <= bounds.blocks) & (h < k) & (hidden_value >= 0) & hidden
    with np.errstate(divide="ignore", invalid="ignore"):
        g_kv = np.where(k > 0, v / np.maximum(k, 1), np.inf)
        g_hid = np.where(h > 0, hidden_value / np.maximum(h, 1), np.inf)
        g_up = penalty * h / np.maximum(k - h, 1)
    # A request splits into hidden half + upgrade when the half gains at least as much per
    # block as KV taken whole (the refinement); with `hidden_fallback`, also when only the
    # half fits alone. Only a split request is offered the hidden cache.
    split = can_hid & (~refined_to_kv(c, penalty) | (~can_kv & rules.hidden_fallback))
    whole = can_kv & ~split
    upgrade = split & can_kv
    rows = np.concatenate([np.flatnonzero(whole), np.flatnonzero(split), np.flatnonzero(upgrade)])
    kind = np.concatenate([np.full(whole.sum(), KV), np.full(split.sum(), HIDDEN),
                           np.full(upgrade.sum(), 2)]).astype(np.int8)  # 2: the upgrade
    gain = np.concatenate([g_kv[whole], g_hid[split], g_up[upgrade]])
    blocks = np.concatenate([k[whole], h[split], (k - h)[upgrade]])
    first = kind != 2
    cost = np.stack([blocks, np.where(first, c.tokens[rows], 0), first.astype(np.float64)], 1)
    # By gain, descending; a tie puts a hidden half before its upgrade (the refinement
    # makes the half's gain >= the upgrade's), then earlier candidates first.
    order = np.lexsort((rows, kind == 2, -gain))
    rows, kind, cost = rows[order], kind[order], cost[order]
    cap = np.array([bounds.blocks, bounds.tokens, bounds.seqs], np.float64)
    taken = _take(cost, cap, rows, kind == 2, rules.skip)
    choice[rows[taken & (kind == KV)]] = KV
    choice[rows[taken & (kind == HIDDEN)]] = HIDDEN
    choice[rows[taken & (kind == 2)]] = KV  # hidden half + upgrade: the KV cache
    # V': the best single schedule that fits alone, of an offered type that fits.
    single = np.maximum(np.where(can_kv, v, -np.inf), np.where(split, hidden_value, -np.inf))
    best = int(np.argmax(single))
    if np.isfinite(single[best]) and single[best] > schedule_values(c, choice, penalty):
        choice[:] = NONE
        choice[best] = KV if can_kv[best] and v[best] >= hidden_value[best] else HIDDEN
    return choice


def _take(cost: np.ndarray, cap: np.ndarray, rows: np.ndarray, is_upgrade: np.ndarray, skip: bool) -> np.ndarray:
    """The greedy pass over items in order (columns of `cost`: blocks, tokens, sequences).
    An item over the tokens or sequences left is passed over; one over the blocks left ends
    the pass (Algorithm 1), or with `skip` is passed over too. An upgrade is taken only after
    its hidden half. Vectorised in rounds: the longest prefix that fits is taken at once; the
    first item that does not is dropped with every later one that cannot fit the capacity
    now left in a bound it is passed over for (capacity only shrinks), and with the upgrades
    whose half is gone."""
    n = len(cost)
    taken = np.zeros(n, bool)
    alive = np.ones(n, bool)
    ups = np.flatnonzero(is_upgrade)
    pos = np.empty(int(rows.max()) + 1 if n else 0, np.int64)
    pos[rows[~is_upgrade]] = np.flatnonzero(~is_upgrade)
    halves = pos[rows[ups]]  # position of each upgrade's hidden half
    passed = slice(0, None) if skip else slice(1, None)  # the bounds an item is passed over for
    while True:
        idx = np.flatnonzero(alive)
        if not len(idx):
            return taken
        cum = np.cumsum(cost[idx], axis=0)
        ok = (cum <= cap).all(axis=1)
        stop = len(idx) if ok.all() else int(np.argmin(ok))
        if stop:
            taken[idx[:stop]] = True
            cap = cap - cum[stop - 1]
        alive[idx[:stop + 1]] = False
        if stop == len(idx) or (cost[idx[stop], passed] <= cap[passed]).all():
            return taken  # all taken, or the first that does not fit ends the pass
        alive &= (cost[:, passed] <= cap[passed]).all(axis=1)
        alive[ups] &= taken[halves] | alive[halves]
