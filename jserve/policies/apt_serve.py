"""Apt-Serve (Gao et al., SIGMOD 2025): each iteration prefills or decodes, whichever queue waited
longer, choosing its batch greedily by value per block (`apt_greedy`) with each request on the KV
cache or the smaller hidden cache; a request past its SLO is worth almost nothing. The paper's
rules, our readings, the variants that keep the other reading and what was measured:
docs/policies.md, Apt-Serve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jserve.cache_features.hidden_cache.section import (
    CacheType,
    blocks_for_type,
    cache_types,
    hidden_view,
    request_types,
    section,
)
from jserve.engine.plan import Plan
from jserve.engine.policy import PolicyCapabilities
from jserve.engine.request import RUNNING, WAITING
from jserve.engine.view import SchedulerView
from jserve.policies.apt_greedy import HIDDEN, KV, NONE, Bounds, Candidates, GreedyRules, greedy_types

FALLBACK_VALUE = 1e-6  # seconds: the "near-zero constant" of a request past its SLO
PAPER_DECAY = 0.4  # Figure 10's decaying factor ("Apt-Serve's scheduling*")


def pending_times(view: SchedulerView, rows: np.ndarray) -> np.ndarray:
    """p_i: since arrival before the first token, since the last token after it (0 for a
    request whose decode step has just ended: its token is stamped at the step's end, when
    the next iteration is scheduled)."""
    r = view.requests
    last = r.last_token_time[rows]
    return view.now - np.where(np.isnan(last), r.arrival_time[rows], last)


def slo_violated(view: SchedulerView, rows: np.ndarray) -> np.ndarray:
    """Requests past their SLO (the module's reading): first token later than the TTFT SLO,
    or still waiting for it beyond it; or, once started, waiting now since the last token
    longer than the TBT SLO (earlier gaps are not remembered). A missing SLO (nan) never
    counts."""
    r = view.requests
    first, arrival = r.first_token_time[rows], r.arrival_time[rows]
    started = ~np.isnan(first)
    ttft = np.where(started, first, view.now) - arrival
    gap = view.now - r.last_token_time[rows]
    with np.errstate(invalid="ignore"):
        return (ttft > r.ttft_slo[rows]) | (started & (gap > r.tbt_slo[rows]))


@dataclass(frozen=True)
class AptServePolicy:
    name: str = "apt-serve"
    chunked_prefill: bool = False
    token_budget: int = 512  # apt-serve-s only (Sarathi's)
    hybrid: bool = True  # False: KV cache only (Table 4)
    adaptive: bool = True  # False: FCFS (Table 5)
    decay: float | None = None  # None: the near-zero fallback; else its decaying factor
    watermark: float = 0.01  # vLLM's free blocks kept at admission
    upgrade_in_step: bool = False  # True: hidden -> KV recomputes in the same step (ours)
    count_late: bool = False  # True: |W| + |R| counts requests past their SLO too (ours)
    hidden_fallback: bool = False  # True: hidden when only the hidden half fits (ours)
    skip: bool = False  # True: the greedy skips a schedule that does not fit (ours)

    @property
    def capabilities(self) -> PolicyCapabilities:
        """The hybrid cache is the policy's, off in its KV-only ablation."""
        return PolicyCapabilities(uses_hidden_cache=self.hybrid)

    def schedule(self, view: SchedulerView) -> Plan:
        r = view.requests
        running, waiting = r.with_status(RUNNING), r.with_status(WAITING)
        if self.chunked_prefill:  # Apt-Serve-S: the running part, then admissions behind it
            return self._prefill(view, running, waiting, self._decode(view, running))
        if len(waiting) and (not len(running) or self._prefill_first(view, running, waiting)):
            plan = self._prefill(view, running, waiting)
            if plan.run or not len(running):
                return plan
        return self._decode(view, running)

    # -- the pieces of the model -------------------------------------------------------

    def _prefill_first(self, view: SchedulerView, running: np.ndarray, waiting: np.ndarray) -> bool:
        if not self.adaptive:
            return True  # vLLM: prefill whenever the head of the queue fits
        return float(pending_times(view, waiting).sum()) >= float(pending_times(view, running).sum())

    def _values(self, view: SchedulerView, rows: np.ndarray) -> np.ndarray:
        p = pending_times(view, rows)
        late = slo_violated(view, rows)
        return np.where(late, FALLBACK_VALUE if self.decay is None else self.decay * p, p)

    def _hidden_ok(self, view: SchedulerView) -> bool:
        return self.hybrid and hidden_view(view).block_tokens > view.block_size

    def candidates(self, view: SchedulerView, rows: np.ndarray, tokens: np.ndarray) -> Candidates:
        """Blocks each request's whole cache takes on each type (m_i): all its tokens, the
        next decode's included; a prompt's whole cache is claimed at admission, also when
        it is computed in chunks (as Sarathi's)."""
        end = view.requests.num_tokens[rows]
        kv = view.blocks_for(end)
        hidden = blocks_for_type(view, end, CacheType.HIDDEN) if self._hidden_ok(view) else kv
        return Candidates(self._values(view, rows), kv, hidden, tokens)

    def _choose(self, view: SchedulerView, rows: np.ndarray, c: Candidates, bounds: Bounds) -> np.ndarray:
        if not self.adaptive:
            return fcfs_types(view, rows, c, bounds, self._hidden_ok(view))
        return greedy_types(c, bounds, self.penalty(view), hidden=self._hidden_ok(view),
                            rules=GreedyRules(skip=self.skip, hidden_fallback=self.hidden_fallback))

    def penalty(self, view: SchedulerView) -> float:
        """(|W| + |R|) * rho of Eq. 5, seconds per hidden block: |W| + |R| the live requests,
        less those past their SLO unless `count_late`."""
        n = len(view.requests)
        counted = n if self.count_late else n - int(slo_violated(view, np.arange(n)).sum())
        return counted * hidden_view(view).block_cost

    def _keep_free(self, view: SchedulerView, running: int) -> int:
        return int(self.watermark * view.num_blocks) if running else 0

    # -- iterations ----------------------------------------------------------------------

    def _prefill(self, view: SchedulerView, running: np.ndarray, waiting: np.ndarray,
                 decodes: Plan | None = None) -> Plan:
        """Admit waiting requests into the blocks free after `decodes` (this iteration's
        running part, Apt-Serve-S) or after the running requests' (a prefill iteration),
        within the token budget it leaves; prompts run whole, or chunked to the budget."""
        r, lim = view.requests, view.limits
        decodes = decodes or Plan()
        kept = len(running) - len(decodes.preempt)
        freed = int(sum(r.num_blocks[i] for i in running if int(r.seq_id[i]) in decodes.preempt))
        free = view.num_free_blocks + freed - sum(decodes.allocate.values()) - self._keep_free(view, kept)
        budget = self._budget(view) - decodes.num_batched_tokens
        remaining = r.num_tokens[waiting] - r.num_computed[waiting]
        tokens = np.minimum(remaining, max(budget, 1)) if self.chunked_prefill else remaining
        c = self.candidates(view, waiting, tokens)
        choice = self._choose(view, waiting, c, Bounds(blocks=free, tokens=budget, seqs=lim.max_num_seqs - kept))
        run, allocate, types = dict(decodes.run), dict(decodes.allocate), dict(cache_types(decodes))
        for k in np.flatnonzero(choice != NONE):  # arrival order
            seq = int(r.seq_id[waiting[k]])
            run[seq] = int(tokens[k])
            allocate[seq] = int((c.kv_blocks if choice[k] == KV else c.hidden_blocks)[k])
            types[seq] = CacheType(int(choice[k]))
        return Plan(run=run, allocate=allocate, preempt=decodes.preempt, features=section(types))

    def _budget(self, view: SchedulerView) -> int:
        lim = view.limits.max_num_batched_tokens
        return min(self.token_budget, lim) if self.chunked_prefill else lim

    def _decode(self, view: SchedulerView, running: np.ndarray) -> Plan:
        """Choose among running requests within the blocks they hold plus the free ones:
        kept on their type they compute (decodes first, then prompt chunks, within the
        budget); left out or switched, preempted by recompute (with `upgrade_in_step`, a
        hidden request moved to KV recomputes on KV in this step when the budget holds it)."""
        r, lim = view.requests, view.limits
        budget = self._budget(view)
        remaining = (r.num_tokens - r.num_computed)[running]
        decoding = remaining == 1
        tokens = np.where(decoding, 1, np.minimum(remaining, max(1, budget - int(decoding.sum()))))
        c = self.candidates(view, running, tokens)
        held = int(r.num_blocks[running].sum())
        choice = self._choose(view, running, c, Bounds(blocks=view.num_free_blocks + held, tokens=budget,
                                                      seqs=lim.max_num_seqs))
        keep = (choice != NONE) & (choice == request_types(view)[running])
        switch = (choice != NONE) & ~keep
        run, allocate, types = {}, {}, {}
        preempt: list[int] = []
        need = np.where(choice == HIDDEN, c.hidden_blocks, c.kv_blocks) - r.num_blocks[running]
        left = budget
        order = np.flatnonzero(keep)
        for k in order[np.argsort(~decoding[order], kind="stable")]:  # decodes first
            n = int(min(tokens[k], left))
            if n < 1:
                continue  # a prompt that gets no chunk this step keeps its blocks
            seq = int(r.seq_id[running[k]])
            run[seq] = n
            left -= n
            if need[k] > 0:
                allocate[seq] = int(need[k])
        for k in self._upgrades(view, running, switch & (choice == KV), left):
            seq = int(r.seq_id[running[k]])  # recomputed on KV now, from its first token
            run[seq], allocate[seq], types[seq] = int(r.num_tokens[running[k]]), int(c.kv_blocks[k]), CacheType.KV
            switch[k] = False
        for k in np.flatnonzero(switch):  # discard; re-prefilled on the new type when admitted
            seq = int(r.seq_id[running[k]])
            preempt.append(seq)
            types[seq] = CacheType(int(choice[k]))
        for k in np.flatnonzero(choice == NONE):
            preempt.append(int(r.seq_id[running[k]]))
        return Plan(run=run, allocate=allocate, preempt=preempt, features=section(types))


    def _upgrades(self, view: SchedulerView, running: np.ndarray, upgrade: np.ndarray, budget: int) -> list[int]:
        """With `upgrade_in_step`, the hidden requests moved to KV that recompute in this
        step: in arrival order, each whose whole context fits the token budget left."""
        if not self.upgrade_in_step:
            return []
        lens = view.requests.num_tokens[running]
        taken = []
        for k in np.flatnonzero(upgrade).tolist():
            if lens[k] <= budget:
                taken.append(k)
                budget -= int(lens[k])
        return taken


def fcfs_types(view: SchedulerView, rows: np.ndarray, c: Candidates, bounds: Bounds, hidden: bool) -> np.ndarray:
    """FCFS with the hybrid cache (the Table 5 ablation): in arrival order, running requests
    first on their own type, then waiting ones on KV if it fits, else hidden; the first that
    fits neither ends the batch (nobody overtakes it)."""
    r, types = view.requests, request_types(view)
    choice = np.full(len(rows), NONE, np.int8)
    blocks, tokens, seqs = bounds.blocks, bounds.tokens, bounds.seqs
    is_running = r.status[rows] == RUNNING
    for k in np.flatnonzero(is_running).tolist() + np.flatnonzero(~is_running).tolist():
        own = int(types[rows[k]]) if is_running[k] else None
        options = [own] if own is not None else ([KV, HIDDEN] if hidden else [KV])
        cost = {KV: int(c.kv_blocks[k]), HIDDEN: int(c.hidden_blocks[k])}
        fit = next((t for t in options if cost[t] <= blocks), None)
        if fit is None or c.tokens[k] > tokens or seqs < 1:
            break
        choice[k] = fit
        blocks, tokens, seqs = blocks - cost[fit], tokens - int(c.tokens[k]), seqs - 1
    return choice
