"""Apt-Serve's hybrid-cache scheduling problem (Gao et al., SIGMOD 2025, Section 5, Eqs. 7-10
and the online appendix's greedy) as a pure numpy function over candidate columns.

Each candidate request i offers at most two items:

- run it on the hidden cache: `hidden_blocks[i]` blocks, value p_i - c * hidden_blocks[i]
  (Eq. 5-6: c = (|W| + |R|) * rho, the extra projection time every live request waits for);
- run it on the KV cache: `kv_blocks[i]` blocks, value p_i.

Eq. 10's marginal gains per block: the hidden half first, (p - c h) / h, then the upgrade to
KV, c h / (k - h) (with h = k / 2 these are the paper's 2p/m - 2 c' and 2 c', c' per KV block).
Where the hidden half gains less per block than KV taken whole (p / k), the request is one
item worth p / k (the paper's refinement); then the gains of a request never increase from
its first item to its second, so sorting by gain keeps each upgrade behind its hidden half.

The greedy takes items by gain per block while they fit (skipping, not stopping at, one that
does not), then compares its total value with the best single schedule that fits alone (the
appendix's 2-approximation, V'). Two gaps in the appendix's argument are closed here, as
issue 16 asks: items that cannot fit alone are removed before the greedy (the fractional
bound the argument uses assumes they are), and the single best schedule takes whichever type
fits (a request whose KV cache does not fit alone may still be the best single schedule on
the hidden cache).

Besides blocks, a schedule may be bounded in batched tokens and sequences (vLLM's
`max_num_batched_tokens` / `max_num_seqs`); the greedy checks every bound at once. With one
bound (blocks) the result is within a factor 2 of the optimum
(`tests/test_apt_serve.py` checks it against brute force).
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


def schedule_values(c: Candidates, choice: np.ndarray, penalty: float) -> float:
    """Sum of the chosen schedules' values (the objective of Definition 1)."""
    kv, hid = choice == KV, choice == HIDDEN
    return float(c.value[kv].sum() + (c.value[hid] - penalty * c.hidden_blocks[hid]).sum())


def greedy_types(c: Candidates, bounds: Bounds, penalty: float, hidden: bool = True) -> np.ndarray:
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
    # block as KV taken whole, or when only the half fits alone.
    split = can_hid & ((g_hid >= g_kv) | ~can_kv)
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
    taken = _take_while_fits(cost, np.array([bounds.blocks, bounds.tokens, bounds.seqs], np.float64),
                             rows, kind == 2)
    choice[rows[taken & (kind == KV)]] = KV
    choice[rows[taken & (kind == HIDDEN)]] = HIDDEN
    choice[rows[taken & (kind == 2)]] = KV  # hidden half + upgrade: the KV cache
    # V': the best single schedule that fits alone, of the type that fits.
    single = np.maximum(np.where(can_kv, v, -np.inf), np.where(can_hid, hidden_value, -np.inf))
    best = int(np.argmax(single))
    if np.isfinite(single[best]) and single[best] > schedule_values(c, choice, penalty):
        choice[:] = NONE
        choice[best] = KV if can_kv[best] and v[best] >= hidden_value[best] else HIDDEN
    return choice


def _take_while_fits(cost: np.ndarray, cap: np.ndarray, rows: np.ndarray, is_upgrade: np.ndarray) -> np.ndarray:
    """The greedy pass over items in order: take each that fits the capacity left, skip the
    rest, and an upgrade only after its hidden half. Vectorised in rounds: the longest
    prefix that fits is taken at once; the first item that does not is dropped with every
    later one that cannot fit the capacity now left (capacity only shrinks), and with the
    upgrades whose half is gone."""
    n = len(cost)
    taken = np.zeros(n, bool)
    alive = np.ones(n, bool)
    ups = np.flatnonzero(is_upgrade)
    pos = np.empty(int(rows.max()) + 1 if n else 0, np.int64)
    pos[rows[~is_upgrade]] = np.flatnonzero(~is_upgrade)
    halves = pos[rows[ups]]  # position of each upgrade's hidden half
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
        if stop == len(idx):
            return taken
        alive &= (cost <= cap).all(axis=1)
        alive[ups] &= taken[halves] | alive[halves]
