"""CacheOpt's pure pieces by hand (padding, SLO order, embedding, amortisation, victim order,
swap/recompute choice), its ablation switches, and RLP's and S3's demands. (Random traces
through the real engine: test_policy_properties.py; real-model outputs: test_engine_greedy.py.)"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from jserve.cache_features.swap_tier.section import PreemptMode, preempt_modes
from jserve.engine.preemption_costs import PreemptionCosts
from jserve.engine.request import RequestStatus
from jserve.engine.request_table import RequestArrays
from jserve.engine.view import SchedulerLimits, SchedulerView
from jserve.policies import CACHEOPT_ABLATIONS, POLICIES
from jserve.policies.cacheopt import (
    CacheOptPolicy,
    amortized_shares,
    confidence,
    deviation_ranges,
    embedding_host,
    hoeffding_padding,
    is_critical,
    padded_outputs,
    remaining_time,
    swap_preferred,
    tbt_bucket,
    victim_order,
)
from jserve.policies.reservation import Ledger, demand_blocks
from jserve.policies.rlp import RLPPolicy
from jserve.policies.s3 import S3Policy, bucket_upper

W, R, S = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED


def view_of(rows: list[dict], num_blocks: int = 64, block_size: int = 4, now: float = 10.0,
            **kw) -> SchedulerView:
    """A hand-made view: each row a request (defaults: waiting 8-token prompt, max_len 100,
    no prediction, no SLO, arrival in row order)."""
    r = RequestArrays.empty(len(rows))
    for k, row in enumerate(rows):
        row = {"seq_id": k, "status": W, "arrival_time": float(k), "prompt_len": 8, "max_len": 100,
               "first_token_time": math.nan, "last_token_time": math.nan, "ttft_slo": math.nan,
               "tbt_slo": math.nan, **row}
        row.setdefault("num_tokens", row["prompt_len"])
        if row["status"] == R:
            row.setdefault("num_computed", row["num_tokens"] - 1)
            row.setdefault("num_blocks", -(-row["num_tokens"] // block_size))
            row.setdefault("reserved_blocks", row["num_blocks"])
        for name, value in row.items():
            getattr(r, name)[k] = value
    used = int(np.maximum(r.num_blocks, 0).sum())
    return SchedulerView(now=now, requests=r, block_size=block_size, num_blocks=num_blocks,
                         num_free_blocks=num_blocks - used,
                         limits=kw.pop("limits", SchedulerLimits(8, 256, 128)), **kw)


# ------------------------------------------------------------------ CKA
def test_hoeffding_padding_and_confidence_by_hand() -> None:
    # t = sqrt(-(b - a)^2 / 2 * ln(1 - c)): (b - a) = 200, c = 0.9 -> sqrt(20000 * ln 10)
    assert hoeffding_padding(-100, 100, 0.9) == pytest.approx(math.sqrt(20000 * math.log(10)))
    assert hoeffding_padding(-100, 100, 0.9) == pytest.approx(214.597, abs=1e-3)
    assert hoeffding_padding(0, 10, 0.5) == pytest.approx(math.sqrt(50 * math.log(2)))
    assert hoeffding_padding(0, np.array([10.0, 0.0]), 0.5).tolist() == pytest.approx([math.sqrt(50 * math.log(2)), 0])
    # c = alpha / (1 + beta * lambda), lambda in requests per ms: 0.9 at no load, and with
    # the paper's beta = 100, 0.45 at 10 req/s and 0.9 / 3.8 at Table 1's 28 req/s.
    assert confidence(0.9, 100.0, 0.0) == pytest.approx(0.9)
    assert confidence(0.9, 100.0, 10.0) == pytest.approx(0.45)
    assert confidence(0.9, 100.0, 28.0) == pytest.approx(0.9 / 3.8)


def test_deviation_ranges_are_per_request_and_per_direction() -> None:
    # true / predicted within [0.5, 3]: p = 100 may be 50 below or 200 above; the context
    # room caps the upper end (p = 100 with room 150: 50 above); never below one token.
    below, above = deviation_ranges(np.array([100, 100, 1]), np.array([1000, 150, 1000]), (0.5, 3.0))
    assert below.tolist() == [50, 50, 0] and above.tolist() == [200, 50, 2]


def test_padding_follows_the_predicted_direction() -> None:
    p, d = np.array([50, 50, 50, 5]), np.array([+1, -1, 0, +1])
    out = padded_outputs(p, d, np.full(4, 10.4), np.full(4, 20.2))
    assert out.tolist() == [39, 71, 71, 1]  # over: down; under or unknown: up; >= 1 token


def test_demand_is_prompt_plus_padded_prediction_capped_at_max_len() -> None:
    view = view_of([
        dict(predicted_len=20, predicted_dir=-1, prompt_len=10),
        dict(predicted_len=20, predicted_dir=+1, prompt_len=10),
        dict(predicted_len=0, prompt_len=10, max_len=70),
        dict(predicted_len=500, predicted_dir=-1, prompt_len=10),
    ])
    policy = CacheOptPolicy(true_to_predicted=(0.5, 2.0))  # no load: c = 0.9
    f = math.sqrt(math.log(10) / 2)  # t = range * f
    assert policy.demand_tokens(view).tolist() == [10 + 20 + math.ceil(20 * f),
                                                   10 + 20 - math.ceil(10 * f), 70, 100]
    no_cka = dataclasses.replace(policy, padding=False)  # /CKA: 10% of the prediction
    assert no_cka.demand_tokens(view).tolist() == [32, 32, 70, 100]
    # In blocks: at least the tokens so far plus the next one, at most max_len's.
    assert demand_blocks(view, 0, 39) == 10 and demand_blocks(view, 0, 3) == 3
    assert demand_blocks(view, 2, None) == 18 and demand_blocks(view, 3, 10**6) == 25


def test_rlp_and_s3_demands() -> None:
    rows = [dict(predicted_len=20), dict(), dict(predicted_len=20, num_preemptions=2),
            dict(predicted_len=50)]
    view = view_of([dict(row, prompt_len=10, max_len=1000) for row in rows])
    assert RLPPolicy().demand_tokens(view, 0) == 10 + 20  # the predictor adds RLP's 100
    assert RLPPolicy(margin_tokens=100).demand_tokens(view, 0) == 10 + 20 + 100
    assert RLPPolicy().demand_tokens(view, 1) is None  # no prediction: max_len
    # Preempted after outgrowing it: its tokens so far plus RLP's 100 again.
    assert RLPPolicy().demand_tokens(view, 2) == 10 + 100
    again = view_of([dict(prompt_len=10, max_len=1000, predicted_len=20, num_preemptions=1, num_tokens=40)])
    assert RLPPolicy().demand_tokens(again, 0) == 40 + 100
    assert bucket_upper(20, 50) == 50 and bucket_upper(50, 50) == 50 and bucket_upper(51, 50) == 100
    assert bucket_upper(0, 50) == 50
    assert S3Policy().demand_tokens(view, 0) == 10 + 50
    assert S3Policy().demand_tokens(view, 2) == 10 + 50 * 4  # doubled per preemption
    assert S3Policy().demand_tokens(view, 3) == 10 + 50  # an upper edge is kept as it is


# ------------------------------------------------------------------ RSA
def test_remaining_time_and_critical() -> None:
    view = view_of([
        dict(arrival_time=1.0, ttft_slo=5.0),  # waiting: 1 + 5 - 10
        dict(status=R, num_tokens=9, last_token_time=9.5, tbt_slo=1.0),  # 9.5 + 1 - 10
        dict(status=R, num_tokens=9, last_token_time=9.5),  # no SLO
        dict(arrival_time=2.0, ttft_slo=20.0, last_token_time=3.0, tbt_slo=8.0),  # recomputed: TBT
    ])
    rt = remaining_time(view)
    assert rt.tolist() == [pytest.approx(-4.0), pytest.approx(0.5), math.inf, pytest.approx(1.0)]
    assert is_critical(rt, 0.7, 0.0).tolist() == [True, True, False, False]
    assert is_critical(rt, 0.3, 0.0).tolist() == [True, False, False, False]


def test_embedding_picks_the_host_with_least_remaining_allocation() -> None:
    alloc = np.array([100, 80, 60, 200])  # a_j, tokens
    used = np.array([10, 10, 10, 180])  # u_j
    # guest: o_i = 10 output tokens, p_i + o_i = 20, b = 8: a - (u + o_i) - 20 = 60, 40, 20,
    # -10 -> rows 0-2 fit; remaining allocation a - u = 90, 70, 50: row 2.
    assert embedding_host(alloc, used, 10, 20, 8) == 2
    # a guest of 35 tokens: row 2's slack is 5 < b, so rows 0 and 1: row 1.
    assert embedding_host(alloc, used, 10, 35, 8) == 1
    assert embedding_host(alloc, used, 10, 80, 8) is None


def test_embedding_moves_a_hosts_unused_allocation_to_the_new_request() -> None:
    # Running seq 0 reserved 20 blocks; the pool is empty (reserve off), so waiting seq 1
    # (8 + 4 predicted tokens + 10% (/CKA) = 13 tokens, 4 blocks) is admitted inside seq
    # 0's slack: 80 - (9 + 5) - 13 >= 8.
    view = view_of([
        dict(status=R, num_tokens=9, reserved_blocks=20, predicted_len=4, prompt_len=8,
             last_token_time=9.0),
        dict(predicted_len=4, predicted_dir=-1),
    ], num_blocks=20)
    policy = CacheOptPolicy(padding=False, global_reserve=False)
    plan = policy.schedule(view)
    assert plan.run == {0: 1, 1: 8}
    assert plan.reserve == {0: 20 - 4, 1: 4}
    assert dataclasses.replace(policy, slo_aware=False).schedule(view).run == {0: 1}


def test_embedding_is_tried_before_the_pool() -> None:
    # The pool could take seq 1, but seq 0's unused allocation is tried first.
    view = view_of([
        dict(status=R, num_tokens=9, reserved_blocks=20, predicted_len=4, prompt_len=8,
             last_token_time=9.0),
        dict(predicted_len=4, predicted_dir=-1),
    ], num_blocks=64)
    plan = CacheOptPolicy(padding=False, global_reserve=False).schedule(view)
    assert plan.reserve == {0: 20 - 4, 1: 4}


def test_critical_waiting_request_preempts_for_its_basic_demand() -> None:
    # A full cache: two running requests hold it all; a waiting request past its TTFT SLO
    # (critical) needs prompt + B; the loosest running one (no TBT SLO) is preempted.
    view = view_of([
        dict(status=R, num_tokens=41, reserved_blocks=16, predicted_len=60, tbt_slo=0.05,
             last_token_time=9.9),
        dict(status=R, num_tokens=41, reserved_blocks=16, predicted_len=60, last_token_time=9.9),
        dict(predicted_len=10, ttft_slo=5.2, arrival_time=5.0),  # 0.2 s left < a 0.5 s step
    ], num_blocks=32, iteration_time=0.5)
    policy = CacheOptPolicy(padding=False, global_reserve=False)
    plan = policy.schedule(view)
    assert preempt_modes(plan) == {1: PreemptMode.RECOMPUTE}
    assert 2 in plan.run and 0 in plan.run
    # Not critical, or its SLO already missed: it waits, nobody is preempted.
    assert not policy.schedule(dataclasses.replace(view, now=1.0)).preempt
    assert not policy.schedule(dataclasses.replace(view, now=10.3)).preempt


def test_amortized_shares_by_hand() -> None:
    rt, prompt = np.array([1.0, 3.0]), np.array([30.0, 10.0])
    # w = RT/sum RT * p/sum p = (1/4 * 3/4, 3/4 * 1/4) = equal: half the supply each.
    assert amortized_shares(10, rt, prompt).tolist() == pytest.approx([5.0, 5.0])
    w = np.array([2 / 6 * 10 / 40, 4 / 6 * 30 / 40])
    assert amortized_shares(12, np.array([2.0, 4.0]), np.array([10.0, 30.0])) == pytest.approx(12 * w / w.sum())
    # No SLO (inf) or past it: clipped, so weights stay finite.
    assert np.isfinite(amortized_shares(12, np.array([np.inf, -1.0]), np.array([1.0, 1.0]))).all()


def test_critical_requests_get_basic_demand_and_the_rest_is_amortized() -> None:
    # 30 blocks, nothing running: three waiting 8-token prompts predicted at 100 tokens
    # (capped at max_len 100: 25 blocks each); seq 2 is critical (its TTFT SLO is past), so it comes first and gets
    # prompt + B = 16 tokens = 4 blocks; the others get their 3-block floor plus shares.
    view = view_of([dict(predicted_len=100), dict(predicted_len=100),
                    dict(predicted_len=100, ttft_slo=1.0, arrival_time=2.0)], num_blocks=30)
    plan = CacheOptPolicy(padding=False).schedule(view)
    assert list(plan.run) == [2, 0, 1]
    assert plan.reserve[2] == 4
    assert plan.reserve[0] + plan.reserve[1] == 30 - 4 and min(plan.reserve[0], plan.reserve[1]) >= 4
    # Without RSA: FCFS, the first one takes its whole demand and the next waits.
    plan = CacheOptPolicy(padding=False, slo_aware=False).schedule(view)
    assert plan.run == {0: 8} and plan.reserve == {0: 25}


# ------------------------------------------------------------------ PP / PSS
def test_victim_order_tbt_range_then_remaining_then_occupancy_in_ranges() -> None:
    edges = (0.05, 0.2, 0.5, 2.0)
    assert tbt_bucket(np.array([0.01, 0.05, 0.3, 2.0, np.nan]), edges).tolist() == [0, 1, 2, 4, 4]
    view = view_of([
        dict(status=R, num_tokens=9, tbt_slo=0.03),  # tight SLO: last
        dict(status=R, num_tokens=300, tbt_slo=0.3),  # range 2, 300 left, 75 blocks (2nd range)
        dict(status=R, num_tokens=100, tbt_slo=0.3),  # range 2, 260 left, 25 blocks (1st range)
        dict(status=R, num_tokens=120, tbt_slo=0.3),  # range 2, 100 left
        dict(status=R, num_tokens=9),  # no SLO: loosest, first
    ], num_blocks=400, limits=SchedulerLimits(8, 512, 512))
    remaining = np.array([90, 300, 260, 100, 0])
    running = view.requests.with_status(R)
    # 300 and 260 left are in one 128-token range (256-384): the smaller KV goes first.
    assert victim_order(view, running, remaining, edges, 128) == [4, 2, 1, 3, 0]
    assert victim_order(view, running, remaining, edges, 1) == [4, 1, 2, 3, 0]


def test_sweet_spot_chooses_swap_above_and_recompute_below() -> None:
    # Recompute 1e-6 S^2 + 1 ms, swap 2e-5 S + 2 ms: they cross near S = 43.
    costs = PreemptionCosts(a=1e-6, b=2.0, k=0.0, e=1e-3, g=2e-5, d=2e-3)
    spot = costs.sweet_spot()
    assert spot == 44
    assert not swap_preferred(costs, spot - 1) and swap_preferred(costs, spot)
    assert swap_preferred(None, 1)  # no fitted costs: swap whenever the host has room
    # In a plan: two running requests, one block short; the victim (latest, PP off) is
    # swapped when large, recomputed when small.
    for tokens, mode in ((100, PreemptMode.SWAP), (20, PreemptMode.RECOMPUTE)):
        # Each holds tokens/4 full blocks and needs one more for its next token; the cache
        # is full, so one of them (the latest, PP off) is preempted.
        row = dict(status=R, num_tokens=tokens + 1, num_computed=tokens, prompt_len=tokens,
                   max_len=200, num_blocks=tokens // 4)
        view = view_of([row, row], num_blocks=tokens // 2, num_host_blocks=100,
                       num_free_host_blocks=100, limits=SchedulerLimits(8, 256, 256))
        policy = CacheOptPolicy(preemption_costs=costs, preemption_order=False)
        assert preempt_modes(policy.schedule(view)) == {1: mode}, tokens
        assert preempt_modes(dataclasses.replace(policy, swap_selection=False).schedule(view)) == {1: PreemptMode.RECOMPUTE}


def test_swap_needs_host_room() -> None:
    row = dict(status=R, num_tokens=13, num_computed=12, num_blocks=3)
    view = view_of([row, row], num_blocks=6, num_host_blocks=2, num_free_host_blocks=2)
    plan = CacheOptPolicy().schedule(view)  # each holds 3 blocks and needs a 4th
    assert list(preempt_modes(plan).values()) == [PreemptMode.RECOMPUTE]



def test_admission_leaves_the_reserve_and_vllms_watermark_free() -> None:
    # 800 blocks of 4 tokens: while something runs, admissions leave the 8-block reserve
    # and vLLM's 1% watermark (8 blocks) unpromised. The running request fills all it holds
    # (nothing to embed into); the waiting 8-token prompt's floor is 4 blocks (8 + B
    # tokens), and without RSA it is reserved its whole demand, max_len's 25.
    def view(free: int) -> SchedulerView:
        held = 800 - free
        return view_of([dict(status=R, num_tokens=4 * held, max_len=4000, last_token_time=9.0),
                        dict()], num_blocks=800)

    co, no_gr, no_rsa = CacheOptPolicy(), POLICIES["cacheopt/GR"](), POLICIES["cacheopt/RSA"]()
    assert co.admission_keep(view(20)) == 16 and no_gr.admission_keep(view(20)) == 8
    assert 1 in co.schedule(view(20)).run and 1 not in co.schedule(view(19)).run
    assert 1 in no_gr.schedule(view(12)).run and 1 not in no_gr.schedule(view(11)).run
    assert 1 in no_rsa.schedule(view(41)).run and 1 not in no_rsa.schedule(view(40)).run
    # Nothing holds KV: nothing to keep free for.
    assert co.admission_keep(view_of([dict()], num_blocks=800)) == 0


# ------------------------------------------------------------------ ablations
def test_each_ablation_turns_off_exactly_its_component() -> None:
    base = CacheOptPolicy()
    for tag, field in CACHEOPT_ABLATIONS.items():
        policy = POLICIES[f"cacheopt/{tag}"]()
        diff = {f.name for f in dataclasses.fields(base) if getattr(base, f.name) != getattr(policy, f.name)}
        assert diff == {"name", field} and getattr(policy, field) is False, tag


def test_switches_change_their_component() -> None:
    view = view_of([dict(status=R, num_tokens=98, tbt_slo=0.03, reserved_blocks=30),
                    dict(status=R, num_tokens=20, predicted_len=20, arrival_time=5.0),
                    dict(status=R, num_tokens=20, arrival_time=3.0)],
                   num_host_blocks=8, num_free_host_blocks=8, arrival_rate=10.0)
    co = CacheOptPolicy()
    off = {tag: POLICIES[f"cacheopt/{tag}"]() for tag in CACHEOPT_ABLATIONS}
    # CKA: Hoeffding padding vs 10% of the prediction
    assert co.demand_tokens(view)[1] > 8 + 22 and off["CKA"].demand_tokens(view)[1] == 8 + 22
    # GR: blocks kept back from admissions while something runs (capped at 1/8 of 64),
    # beside vLLM's 1% watermark (0 blocks of 64); the watermark stays without GR.
    assert co.admission_keep(view) == 8 and off["GR"].admission_keep(view) == 0
    # PA: a request reserved 5 blocks, estimated at 8 + 14 = 22 tokens (6 blocks), has 20:
    # it completes within m = 2 iterations and is topped up to its demand.
    near = view_of([dict(status=R, num_tokens=20, prompt_len=8, predicted_len=12, reserved_blocks=5,
                         last_token_time=9.9)])
    pa = dataclasses.replace(co, padding=False)
    assert pa._top_up(near, Ledger.of(near), pa.estimates(near), 0) == [(0, 5, 6)]
    assert dataclasses.replace(pa, proactive=False)._top_up(near, Ledger.of(near), pa.estimates(near), 0) == []
    remaining = co.estimates(view).remaining
    # PSS: swap vs always recompute
    assert co.wants_swap(view, 1) and not off["PSS"].wants_swap(view, 1)
    # PP: the loosest SLO with the most remaining tokens vs the latest arrival
    r = view.requests
    # (seq 2: 80 tokens left, seq 1: under 80; one 128-token range, so the later arrival)
    assert victim_order(view, r.with_status(R), remaining, co.tbt_buckets, 1)[0] == 2
    assert victim_order(view, r.with_status(R), remaining, co.tbt_buckets, 128)[0] == 1
    # RSA: off runs vLLM's prefill-first steps (see also the embedding / amortisation tests)
    with_waiting = view_of([dict(status=R, num_tokens=9, last_token_time=9.0), dict()])
    assert co.schedule(with_waiting).run == {0: 1, 1: 8}
    assert off["RSA"].schedule(with_waiting).run == {1: 8}


def test_pp_ranks_victims_by_the_predicted_not_the_padded_remaining() -> None:
    # Three running requests hold all 30 blocks; row 2 needs one more, so one is preempted.
    # Row 0 was predicted 20 tokens and padded up (about 60 estimated left, none predicted);
    # row 1 was predicted 90 and padded down (none estimated left, 58 predicted). Section
    # 3.4 preempts the most remaining *predicted* tokens: row 1, not the padded-up row 0.
    rows = [dict(status=R, num_tokens=40, predicted_len=20, predicted_dir=-1),
            dict(status=R, num_tokens=40, predicted_len=90, predicted_dir=+1),
            dict(status=R, num_tokens=41, num_computed=40, num_blocks=10, predicted_len=10)]
    view = view_of([dict(row, reserved_blocks=10) for row in rows], num_blocks=30)
    co = CacheOptPolicy(token_range=1)
    est = co.estimates(view)
    assert est.remaining.tolist() == [60, 0, 35]
    assert est.predicted_remaining.tolist() == [0, 58, 0]
    assert co.schedule(view).preempt == (1,)
