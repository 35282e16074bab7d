"""CacheOpt (Shen, Sen, Tanaka, "Mitigating KV Cache Competition to Enhance User Experience in
LLM Inference"): prediction-padded KV allocation, SLO-aware batching and allocation, proactive
top-ups, a global reserve, and preemption that picks its victims and its mode; each component
can be switched off (`cacheopt/CKA` ...). Every component against the paper, with our readings:
docs/policies.md, CacheOpt (and bench/results/cacheopt_components.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from jserve.engine.plan import Plan
from jserve.engine.policy import PolicyCapabilities, RunnerCosts
from jserve.engine.preemption_costs import PreemptionCosts
from jserve.engine.request import RequestStatus
from jserve.engine.view import SchedulerView
from jserve.policies.reservation import (
    Ledger,
    Work,
    admit_in_order,
    decode_running,
    demand_blocks,
    demand_blocks_of,
    evict,
    latest_arrival_first,
    swap_in_waiting,
)
from jserve.policies.vllm import VLLMPolicy

RT_CLIP = (1e-3, 60.0)  # seconds; our choice: RT weights stay finite without an SLO (inf)
# The shipped CacheOpt predictor's held-out errors (jserve/predictor/default/noise.json, 500
# prompts): true / predicted output length lies in [0.132, 6.40] for 90% of them (5th and
# 95th percentiles, pooled over its calibration bins). A retrained predictor changes these.
TRUE_TO_PREDICTED = (0.132, 6.40)
CKA_OFF_PADDING = 0.10  # the paper's /CKA: a fixed padding of 10% of the prediction


# ------------------------------------------------------------------ CKA: padding
def confidence(alpha: float, beta: float, arrival_rate: float) -> float:
    """Equation (4), c = alpha / (1 + beta * lambda), with lambda in requests per
    millisecond (our reading: the paper gives no unit; with beta = 100 and lambda in
    requests per second, c would fall below 0.01 at every rate of its Table 1)."""
    return alpha / (1.0 + beta * max(arrival_rate, 0.0) / 1000.0)


def hoeffding_padding(lo: np.ndarray | float, hi: np.ndarray | float, c: float) -> np.ndarray:
    """Equation (3): Hoeffding's t for one sample bounded in [lo, hi], P(err >= t) <= 1 - c."""
    return np.sqrt(-((np.asarray(hi) - np.asarray(lo)) ** 2) / 2.0 * math.log(1.0 - c))


def deviation_ranges(predicted: np.ndarray, room: np.ndarray,
                     ratio: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """Per request, the width of the range its true output length may take on either side
    of its prediction p (the paper's b_i - a_i, one range per direction): below, from
    max(1, p * ratio_lo) up to p; above, from p up to min(room, p * ratio_hi), `room` being
    the most output tokens its context allows."""
    p = predicted.astype(np.float64)
    below = p - np.maximum(1.0, p * ratio[0])
    above = np.minimum(room.astype(np.float64), p * ratio[1]) - p
    return np.maximum(below, 0.0), np.maximum(above, 0.0)


def padded_outputs(predicted: np.ndarray, direction: np.ndarray, pad_down: np.ndarray,
                   pad_up: np.ndarray) -> np.ndarray:
    """The output length to allocate for: p - t when the predictor expects to over-predict
    (+1), p + t otherwise (-1: under-predicts; 0: unknown, our choice: the safe side); at
    least one token."""
    down = np.floor(predicted - pad_down)
    up = np.ceil(predicted + pad_up)
    return np.maximum(1, np.where(direction > 0, down, up)).astype(np.int64)


# ------------------------------------------------------------------ RSA: SLO order
def remaining_time(view: SchedulerView) -> np.ndarray:
    """Seconds each request has left before missing its SLO: before its first token,
    arrival + TTFT SLO - now; after it (running, swapped, or recomputed), last token + TBT
    SLO - now. No SLO: +inf (they keep FCFS order among themselves)."""
    r = view.requests
    started = ~np.isnan(r.last_token_time)
    rt = np.where(started, r.last_token_time + r.tbt_slo, r.arrival_time + r.ttft_slo) - view.now
    return np.where(np.isnan(rt), np.inf, rt)


def is_critical(rt: np.ndarray, iteration_time: float, eps: float) -> np.ndarray:
    """Requests that miss their SLO unless they run in the next iteration."""
    return rt - iteration_time < eps


def slo_order(idx: np.ndarray, rt: np.ndarray, critical: np.ndarray, arrival: np.ndarray) -> list[int]:
    """Critical first, then by remaining time, then by arrival (then `idx` order)."""
    return idx[np.lexsort((arrival[idx], rt[idx], ~critical[idx]))].tolist()


def embedding_host(alloc: np.ndarray, used: np.ndarray, guest_output: int, guest_total: int,
                   buffer: int) -> int | None:
    """Index of the running request whose unused allocation takes a new request (Section
    3.3.1): after the guest's `guest_output` iterations the host has used
    `u_j + guest_output` tokens, so it fits where `a_j - (u_j + o_i) - (p_i + o_i) >= b`
    (all in tokens); among those, the one with the least remaining allocation `a_j - u_j`."""
    ok = np.flatnonzero(alloc - (used + guest_output) - guest_total >= buffer)
    if not len(ok):
        return None
    return int(ok[np.argmin((alloc - used)[ok])])


def amortized_shares(supply: float, rt: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """Supply split by `w_i = RT_i / sum RT * p_i / sum p` (normalised); RT is clipped to
    `RT_CLIP` (our choice) so that requests without an SLO, or past it, get finite weights."""
    rt = np.clip(rt, *RT_CLIP)
    w = rt / rt.sum() * prompt / prompt.sum()
    return supply * w / w.sum()


# ------------------------------------------------------------------ PP / PSS
def predicted_remaining(view: SchedulerView) -> np.ndarray:
    """Output tokens each request still has to generate by its *predicted* length, the
    predictor's own output before any padding (Section 3.4 orders victims by "the remaining
    predicted output tokens"; Section 2.1 keeps "predicted" and the padded "estimated"
    lengths apart). Without a prediction: what `max_len` leaves. Ranking by the padded
    estimate instead puts every request CKA padded up (up to `true_to_predicted[1]` times its
    prediction) first, so the same few were preempted again after every re-admission."""
    r = view.requests
    end = np.where(r.predicted_len > 0, r.prompt_len + r.predicted_len, r.max_len)
    return np.maximum(end.astype(np.int64) - r.num_tokens, 0)


def tbt_bucket(tbt_slo: np.ndarray, edges: tuple[float, ...]) -> np.ndarray:
    """Range bucket of each TBT SLO (0: tightest); no SLO: the loosest bucket."""
    b = np.searchsorted(np.asarray(edges), tbt_slo, side="right")
    return np.where(np.isnan(tbt_slo), len(edges), b)


def victim_order(view: SchedulerView, idx: np.ndarray, remaining: np.ndarray,
                 edges: tuple[float, ...], token_range: int) -> list[int]:
    """Running requests `idx` in the order they are preempted (Section 3.4): loosest TBT
    range first, then the most remaining predicted tokens, then the least KV held, the last
    two compared in ranges of `token_range` tokens (then the latest arrival)."""
    r = view.requests
    bucket = tbt_bucket(r.tbt_slo[idx], edges)
    left = remaining[idx] // token_range
    held = r.num_blocks[idx].astype(np.int64) * view.block_size // token_range
    seq = r.seq_id[idx].astype(np.int64)
    return idx[np.lexsort((-seq, -r.arrival_time[idx], held, -left, -bucket))].tolist()


def ranked_on_demand(order: Callable[[], list[int]]) -> Callable[[int], int]:
    """A key giving each row its place in `order()`, which is computed at the first call
    only: most steps preempt nobody and never ask."""
    rank: dict[int, int] = {}

    def key(i: int) -> int:
        if not rank:
            rank.update((row, k) for k, row in enumerate(order()))
        return rank[i]

    return key


def swap_preferred(costs: PreemptionCosts | None, cached_tokens: int) -> bool:
    """Swap at or above the sweet spot of the fitted latency curves, recompute below it;
    without fitted costs, always swap (the host's room is checked by the caller)."""
    return costs is None or cached_tokens >= costs.sweet_spot()


# ------------------------------------------------------------------ the policy
@dataclass(frozen=True)
class Estimates:
    """Per-request figures of one step, aligned with the view's rows."""

    total: np.ndarray  # prompt + estimated (padded) output: the demand M_i, in tokens
    remaining: np.ndarray  # estimated output tokens still to come
    predicted_remaining: np.ndarray  # predicted (unpadded) output tokens still to come: PP's key
    rt: np.ndarray  # remaining time to the SLO, seconds
    critical: np.ndarray


@dataclass(frozen=True)
class CacheOptPolicy:
    """Defaults are the paper's Section 5 settings where it gives them: B = 8 tokens (one
    8-token block), m = 2 iterations, 8 reserved blocks, confidence 90% (alpha = 0.9),
    beta = 100, embedding buffer b = 8 tokens, 128-token ranges for remaining time and KV
    occupancy. vLLM's: the 1% admission watermark. Ours: TBT ranges at the paper's example
    edges 0.05 / 0.2 / 0.5 / 2 s, `TRUE_TO_PREDICTED` (the predictor's measured error range),
    critical_eps = 0 s, and the reserve capped at 1/8 of the cache so that a small cache is
    not all reserve."""

    name: str = "cacheopt"
    chunked_prefill: bool = False  # built on vLLM: whole-prompt prefills
    buffer_tokens: int = 8  # B
    proactive_iterations: int = 2  # m
    reserved_pool_blocks: int = 8
    admission_watermark: float = VLLMPolicy.watermark  # share of the blocks
    alpha: float = 0.9
    beta: float = 100.0
    embed_buffer_tokens: int = 8  # b
    true_to_predicted: tuple[float, float] = TRUE_TO_PREDICTED
    critical_eps: float = 0.0
    tbt_buckets: tuple[float, ...] = (0.05, 0.2, 0.5, 2.0)
    token_range: int = 128
    preemption_costs: PreemptionCosts | None = None
    padding: bool = True  # CKA
    slo_aware: bool = True  # RSA
    proactive: bool = True  # PA
    global_reserve: bool = True  # GR
    preemption_order: bool = True  # PP
    swap_selection: bool = True  # PSS
    capabilities: ClassVar[PolicyCapabilities] = PolicyCapabilities(
        predictor_kind="cacheopt", reserves=True, reads_runner_costs=True)

    def given(self, costs: RunnerCosts) -> CacheOptPolicy:
        """With the runner's preemption costs, unless it has its own."""
        if self.preemption_costs is not None:
            return self
        return replace(self, preemption_costs=costs.preemption)

    # ---- demand
    def demand_tokens(self, view: SchedulerView) -> np.ndarray:
        """M_i = prompt + estimated output: the prediction padded by Hoeffding's t over its
        own deviation range at the load-adjusted confidence (CKA), or by 10% (/CKA); capped
        at `max_len`, and `max_len` itself without a prediction."""
        r = view.requests
        pred = r.predicted_len.astype(np.float64)
        if self.padding:
            below, above = deviation_ranges(pred, r.max_len - r.prompt_len, self.true_to_predicted)
            c = confidence(self.alpha, self.beta, view.arrival_rate)
            out = padded_outputs(pred, r.predicted_dir, hoeffding_padding(0.0, below, c),
                                 hoeffding_padding(0.0, above, c))
        else:
            out = np.ceil(pred * (1.0 + CKA_OFF_PADDING)).astype(np.int64)
        total = np.where(r.predicted_len > 0, r.prompt_len + out, r.max_len)
        return np.minimum(total, r.max_len)

    def admission_keep(self, view: SchedulerView) -> int:
        """Blocks admissions and allocations leave free while anything holds KV to extend:
        the global reserve (GR) plus vLLM's admission watermark, which Section 4 does not
        list among the vLLM functions CacheOpt changes (`admission_watermark`)."""
        r = view.requests
        if not ((r.status == RequestStatus.RUNNING) | (r.status == RequestStatus.SWAPPED)).any():
            return 0
        reserve = min(self.reserved_pool_blocks, view.num_blocks // 8) if self.global_reserve else 0
        return reserve + int(self.admission_watermark * view.num_blocks)

    def wants_swap(self, view: SchedulerView, i: int) -> bool:
        return self.swap_selection and swap_preferred(self.preemption_costs,
                                                      int(view.requests.num_computed[i]))

    def estimates(self, view: SchedulerView) -> Estimates:
        r = view.requests
        total = self.demand_tokens(view)
        rt = remaining_time(view)
        return Estimates(total, np.maximum(total - r.num_tokens, 0), predicted_remaining(view), rt,
                         is_critical(rt, view.iteration_time, self.critical_eps))

    # ---- the step
    def schedule(self, view: SchedulerView) -> Plan:
        r = view.requests
        est = self.estimates(view)
        total, rt, critical = est.total, est.rt, est.critical

        def order(status: int) -> list[int]:
            idx = r.with_status(status)
            return slo_order(idx, rt, critical, r.arrival_time) if self.slo_aware else list(idx)

        def demand(i: int) -> int:  # critical: the basic demand, tokens so far + B
            if self.slo_aware and critical[i]:
                return demand_blocks(view, i, min(int(r.num_tokens[i]) + self.buffer_tokens, int(total[i])))
            return demand_blocks(view, i, int(total[i]))

        running = r.with_status(RequestStatus.RUNNING)
        if self.preemption_order:
            victim_key = ranked_on_demand(lambda: victim_order(view, running, est.predicted_remaining,
                                                               self.tbt_buckets, self.token_range))
        else:
            victim_key = latest_arrival_first(view)
        ledger, work = Ledger.of(view), Work()
        swapped = (r.status == RequestStatus.SWAPPED).any()
        keep = self.admission_keep(view)
        if not self.slo_aware and not swapped:  # vLLM: prefill-first steps
            self._top_up(view, ledger, est, keep)
            admit_in_order(view, ledger, work, r.with_status(RequestStatus.WAITING),
                           lambda i: demand_blocks(view, i, int(total[i])), keep)
            if work.run:
                return work.plan(ledger)
        wants_swap = lambda i: self.wants_swap(view, i)  # noqa: E731
        decode_running(view, ledger, work, order(RequestStatus.RUNNING), victim_key, wants_swap)
        if not work.preempt:
            swap_in_waiting(view, ledger, work, order(RequestStatus.SWAPPED), demand)
        if not work.preempt and not swapped:
            if self.slo_aware:
                self._admit(view, ledger, work, order(RequestStatus.WAITING), est, keep,
                            victim_key, wants_swap)
            else:
                self._top_up(view, ledger, est, keep)
        return work.plan(ledger)

    def _top_up(self, view: SchedulerView, ledger: Ledger, est: Estimates, keep: int,
                ) -> list[tuple[int, int, int]]:
        """PA (Section 3.3.3): unfulfilled running requests (reserved less than their demand)
        predicted to complete within m iterations. With RSA they join the non-critical
        allocation (returned as (row, held, demand) rows); without it they are topped up
        here from what the reserve leaves, oldest first."""
        if not self.proactive:
            return []
        r = view.requests
        running = r.with_status(RequestStatus.RUNNING)
        want = demand_blocks_of(view, running, est.total[running])
        have = ledger.get_many(running)
        pick = (est.remaining[running] <= self.proactive_iterations) & (have < want)
        rows = list(zip(running[pick].tolist(), have[pick].tolist(), want[pick].tolist()))
        if not self.slo_aware:
            for i, have, want in rows:
                extra = min(want - have, ledger.pool - keep)
                if extra > 0:
                    ledger.set(i, have + extra)
        return rows

    def _admit(self, view: SchedulerView, ledger: Ledger, work: Work, queue: list[int],
               est: Estimates, keep: int, victim_key, wants_swap) -> None:
        """RSA (Section 3.3.2): waiting requests in SLO order until the token budget or
        `max_num_seqs` runs out. Each is embedded into a running request's unused
        allocation if one takes it, else given its floor (tokens so far + B) from the pool
        less the reserve; for a critical request that does not fit, non-critical running
        requests are preempted (in the PP order) if that frees enough. The admitted and the
        proactive top-ups (PA) then share the rest of the pool (`_grant`)."""
        r, lim = view.requests, view.limits
        total, critical = est.total, est.critical
        holders = int((r.status == RequestStatus.RUNNING).sum()) - len(work.preempt) + len(work.swap_in)
        picked: list[tuple[int, int, int]] = []  # (row, floor, target) in blocks
        topped = False
        taken, budget = 0, lim.max_num_batched_tokens - work.num_tokens
        for i in queue:
            tokens = int(r.num_tokens[i] - r.num_computed[i])
            if tokens > budget or holders >= lim.max_num_seqs:
                break
            if not critical[i] and not topped:  # PA joins the non-critical group
                topped = True
                picked += self._top_up(view, ledger, est, keep)
            need = view.blocks_for(int(r.num_tokens[i]))
            full = max(need, demand_blocks(view, i, int(total[i])))
            floor = max(need, demand_blocks(view, i, min(int(r.num_tokens[i]) + self.buffer_tokens,
                                                         int(total[i]))))
            if self._embed(view, ledger, work, i, est):
                pass
            elif floor <= ledger.pool - keep - taken or (
                    self._may_preempt_for(view, i, est) and self._preempt_for(view, ledger, work, floor - (ledger.pool - keep - taken),
                                                      est, victim_key, wants_swap)):
                picked.append((i, floor, floor if critical[i] else full))
                taken += floor
            else:
                break
            budget -= tokens
            holders += 1
        if not topped:
            picked = self._top_up(view, ledger, est, keep) + picked
        self._grant(view, ledger, work, picked, ledger.pool - keep - taken, est.rt)

    @staticmethod
    def _may_preempt_for(view: SchedulerView, i: int, est: Estimates) -> bool:
        """N_w of Section 3.3.2: a waiting request that has not started (its TTFT SLO is
        at stake; a preempted request waits by its TBT SLO and preempts nobody) and is
        critical, while its SLO can still be met (RT >= 0: "in order to satisfy" it)."""
        r = view.requests
        return bool(est.critical[i] and np.isnan(r.first_token_time[i]) and est.rt[i] >= 0)

    def _preempt_for(self, view: SchedulerView, ledger: Ledger, work: Work, short: int,
                     est: Estimates, victim_key, wants_swap) -> bool:
        """Free `short` blocks for a critical waiting request by preempting non-critical
        running requests in the PP order, or preempt nobody if they cannot free enough."""
        r = view.requests
        rows = {int(r.seq_id[i]): int(i) for i in r.with_status(RequestStatus.RUNNING)}
        candidates = sorted((rows[s] for s in work.run if s in rows and s not in work.swap_in
                             and not est.critical[rows[s]]), key=victim_key)
        chosen, freed = [], 0
        for i in candidates:
            if freed >= short:
                break
            chosen.append(i)
            freed += ledger.get(i)
        if freed < short:
            return False
        for i in chosen:
            seq = int(r.seq_id[i])
            del work.run[seq]
            work.allocate.pop(seq, None)
            work.preempt[seq] = evict(view, ledger, i, wants_swap(i))
        return True

    def _grant(self, view: SchedulerView, ledger: Ledger, work: Work,
               picked: list[tuple[int, int, int]], rest: int, rt: np.ndarray) -> None:
        """Top the picked up from their floor towards their target: all of it if the rest
        of the pool allows, else by the amortised shares `w_i` of the supply."""
        r = view.requests
        rest = max(rest, 0)
        extra = [t - f for _, f, t in picked]
        if sum(extra) <= rest:
            grants = extra
        else:
            rows = np.array([i for i, _, _ in picked])
            supply = rest + sum(f for _, f, _ in picked)
            shares = amortized_shares(supply, rt[rows], r.prompt_len[rows].astype(np.float64))
            grants = []
            for (_, f, t), sh in zip(picked, shares):
                grants.append(min(max(0, min(t, int(sh)) - f), rest))
                rest -= grants[-1]
        for (i, floor, _), g in zip(picked, grants):
            if r.status[i] != RequestStatus.RUNNING:  # an admission
                ledger.set(i, floor + g)
                work.schedule(view, i, view.blocks_for(int(r.num_tokens[i])))
            elif int(r.seq_id[i]) not in work.preempt and g:  # a top-up, unless preempted meanwhile
                ledger.set(i, ledger.get(i) + g)

    def _embed(self, view: SchedulerView, ledger: Ledger, work: Work, i: int, est: Estimates) -> bool:
        """Admit request `i` into the unused allocation of a running request (Section
        3.3.1): the guest's demand M_i moves from the host's reservation to its own."""
        r, bs = view.requests, view.block_size
        running = r.with_status(RequestStatus.RUNNING)
        hosts = running[np.isin(r.seq_id[running], np.fromiter(work.run, np.int64, len(work.run)))]
        if not len(hosts):
            return False
        guest_total = int(est.total[i])
        take = max(view.blocks_for(int(r.num_tokens[i])), demand_blocks(view, i, guest_total))
        guest_out = int(est.remaining[i])
        alloc = ledger.get_many(hosts)
        used = r.num_tokens[hosts].astype(np.int64)
        # Block-level safety beside the paper's token condition: the host keeps the blocks
        # it holds after this step and those the guest's iterations will fill.
        safe = alloc - take >= view.blocks_for(used + guest_out + 1)
        alloc_tokens = np.where(safe, alloc * bs, -(1 << 40))
        k = embedding_host(alloc_tokens, used, guest_out, guest_total, self.embed_buffer_tokens)
        if k is None:
            return False
        j = int(hosts[k])
        ledger.set(j, int(alloc[k]) - take)
        ledger.set(i, take)
        work.schedule(view, i, view.blocks_for(int(r.num_tokens[i])))
        return True
