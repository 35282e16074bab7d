"""LayerKV's scheduler and offload rules (`jserve.policies.layerkv`): its pure functions
against Eqs. 1, 2 (Algorithm 1) and 5 of the paper, worked by hand."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from property_examples import examples
from policy_harness import Harness, aborts_strategy, configs, specs_for

from jserve.cache_features.layer_offload.section import NAME, LayerView, kept
from jserve.engine.layerkv_costs import LayerKVCosts
from jserve.engine.request import OFFLOADED, RUNNING, WAITING
from jserve.engine.request_table import RequestArrays
from jserve.engine.view import SchedulerLimits, SchedulerView
from jserve.policies import POLICIES
from jserve.policies.layerkv import (
    Forecast,
    LayerKVPolicy,
    allowed_prefill_time,
    forecast_free,
    future_tokens,
)


def test_future_tokens_from_the_predicted_buckets_lower_edge():
    unknown = np.zeros(2, bool)
    # bucket (100, 150] predicted as 150: lower edge 101; 30 generated -> 71 to come
    assert future_tokens(np.array([30]), np.array([150]), unknown[:1], 50).tolist() == [71]
    # a prediction capped inside the bucket by max_tokens (130) stands for the same bucket
    assert future_tokens(np.array([30]), np.array([130]), unknown[:1], 50).tolist() == [71]
    # already past the lower edge, or no prediction: at least one
    assert future_tokens(np.array([120, 5]), np.array([150, 0]), unknown, 50).tolist() == [1, 1]


def test_future_tokens_of_a_known_length_are_what_is_left_of_it():
    # 512 tokens known (ignore_eos, max_tokens 512), 30 generated: 482 to come, not the
    # 451 of the bucket (450, 500] a prediction of 500 stands for
    known = np.array([True, True])
    assert future_tokens(np.array([30, 512]), np.array([512, 512]), known, 50).tolist() == [482, 1]


def test_eq1_allowed_prefill_time():
    # TPOT SLO 0.2 s; 10 tokens after the first in 1.0 s; 30 to come at a current TPOT of
    # 0.1 s: 0.2 * 40 - (1.0 + 3.0) = 4.0 s of prefill keeps its mean at 0.2 s
    allow = allowed_prefill_time(np.array([0.2]), np.array([10]), np.array([30]), np.array([1.0]), 0.1)
    assert allow.tolist() == pytest.approx([4.0])
    # admitting exactly that much: the request ends at (1 + 3 + 4) / 40 = 0.2 s per token
    assert (1.0 + 3.0 + allow[0]) / 40 == pytest.approx(0.2)
    # behind its SLO already: negative; no SLO: inf; a per-request current TPOT
    out = allowed_prefill_time(np.array([0.1, math.nan, 0.2]), np.array([10, 3, 0]),
                               np.array([1, 1, 4]), np.array([2.0, 1.0, 0.05]), np.array([0.2, 0.1, 0.05]))
    assert out[0] == pytest.approx(0.1 * 11 - (2.0 + 0.2)) and out[0] < 0
    assert out[1] == math.inf
    assert out[2] == pytest.approx(0.2 * 4 - (0.05 + 0.05 * 4))


def _forecast(held=(), ends=(), need=(), queue_held=(), queue_ends=(), grow=2) -> Forecast:
    a = lambda v: np.asarray(v, np.float64)
    return Forecast(a(held), a(ends), a(need), a(queue_held), a(queue_ends), grow)


def test_eq5_running_requests_grow_and_release_at_their_predicted_end():
    # two running requests (grow 2 slots a stage); the first ends after 2 stages holding 10
    f = _forecast(held=[10, 6], ends=[2, math.inf])
    # t0: -2-2 = 16; t1: -4 = 12; t2: the first ends and releases its 10 + 2 stages' growth,
    # the other grows: 12 + 14 - 2 = 24; t3: 22
    assert forecast_free(20, f, 4, threshold=0).tolist() == [20, 16, 12, 24, 22]


def test_eq5_waiting_requests_join_oldest_first_while_the_threshold_holds():
    # nobody runs; the queue needs 8 and then 8: the first joins at once (20 - 8 - 2 = 10 >=
    # 5), the second would leave 0 < 5 and waits; the first keeps growing
    f = _forecast(need=[8, 8], queue_held=[0, 0], queue_ends=[math.inf, math.inf])
    assert forecast_free(20, f, 3, threshold=5).tolist() == [20, 10, 8, 6]
    # a joined request ends `queue_ends` stages after it joined and releases what it holds
    g = _forecast(need=[8], queue_held=[4], queue_ends=[1])
    # t0: joins (20 - 8 - 2 = 10); t1: ends, releases 4 + 8 + 2 = 14 -> 24
    assert forecast_free(20, g, 3, threshold=0).tolist() == [20, 10, 24, 24]


# --------------------------------------------------------------------------- on constructed views
L = 4  # layers of the constructed views
BS = 16
# Round figures: Eq. 3 gives 1 s per 100-token prompt (alpha 1, 1e9 params at 2e11 FLOP/s;
# the quadratic term is negligible), and the link hides every layer (x_min = 0).
COSTS = LayerKVCosts(num_params=1e9, hidden_size=1, kv_dim=8, dtype_bytes=2, flops=2e11,
                     pcie_bandwidth=1e12, decode_base=0.05)


def make_view(rows: list[dict], *, num_blocks: int = 100, free: int = 0, free_host: int = 1000,
              now: float = 100.0, num_layers: int = L, slots: np.ndarray | None = None) -> SchedulerView:
    """A view of `rows` (column values, the layer feature's `device_layers` among them; unset
    ones 0, SLOs and token times nan, every layer kept)."""
    r = RequestArrays.empty(len(rows))
    for name in ("first_token_time", "last_token_time", "ttft_slo", "tbt_slo"):
        getattr(r, name)[:] = np.nan
    kept = np.full(len(rows), num_layers, np.int16)  # the feature's column, `device_layers`
    r.max_len[:] = 10_000
    for i, row in enumerate(rows):
        r.seq_id[i] = i
        kept[i] = row.get("device_layers", num_layers)
        for name, value in row.items():
            if name != "device_layers":
                getattr(r, name)[i] = value
    return SchedulerView(now=now, requests=r, block_size=BS, num_blocks=num_blocks, num_free_blocks=free,
                         limits=SchedulerLimits(256, 100_000, 10_000), num_host_blocks=free_host,
                         num_free_host_blocks=free_host,
                         features={NAME: LayerView(num_layers, slots, device_layers=kept)})


def decoding(arrival: float, first: float, generated: int, prompt: int = 32, slo: float = 0.2,
             predicted: int = 0, status: int = RUNNING, **kw) -> dict:
    n = prompt + generated
    return {"status": status, "arrival_time": arrival, "prompt_len": prompt, "num_tokens": n,
            "num_computed": n - 1, "num_blocks": -(-n // BS), "first_token_time": first,
            "last_token_time": first, "tbt_slo": slo, "predicted_len": predicted, **kw}


def waiting(arrival: float, prompt: int = 100) -> dict:
    return {"status": WAITING, "arrival_time": arrival, "prompt_len": prompt, "num_tokens": prompt}


def test_algorithm1_on_a_view_gates_the_prefills_that_need_offloading():
    # two decoding requests (TPOT SLO 0.2 s): 20 tokens after the first in 2 s, 1 to come
    # (no prediction): T_allow = 0.2 * 21 - (2 + 0.05 * 1) with the fitted decode line's
    # 0.05 s + 0 per sequence; the tighter one decides
    d = [decoding(0.0, 98.0, 21), decoding(1.0, 98.0, 21, slo=0.15)]
    allow = min(0.2 * 21 - 2.05, 0.15 * 21 - 2.05)  # 1.1 s
    q = [waiting(10.0 + k) for k in range(3)]  # 1 s of Eq. 3 each
    policy = LayerKVPolicy(costs=COSTS)
    view = make_view(d + q, free=0)  # no whole block free: every prompt needs offloading
    assert policy.min_allowed_prefill_time(view) == pytest.approx(allow)
    plan = policy.schedule(view)
    assert allow < 2 * COSTS.prefill_time(100)  # Eq. 2: one prompt's 1 s fits, two do not
    assert list(plan.run) == [2] and dict(kept(plan)) == {2: 0}
    assert plan.allocate[2] == 7  # its logical blocks, all of them host slots
    # without the SLO-aware scheduler (the ablation) all three go, every layer offloaded
    ablation = LayerKVPolicy(name="layerkv/SLO", slo_aware=False, costs=COSTS).schedule(view)
    assert list(ablation.run) == [2, 3, 4] and set(kept(ablation).values()) == {0}
    # prompts vLLM would admit (whole blocks free) go whole, whatever T_allow says
    roomy = policy.schedule(make_view(d + q, free=60))
    assert list(roomy.run) == [2, 3, 4] and not kept(roomy)


def test_eq1_current_tpot_with_the_whole_block_return_is_the_running_batchs_step():
    # a decode line of 0.05 s + 0.01 s per sequence; one request runs, three wait to decode
    # with their layers on the host: the current TPOT is a step of the one running
    # (0.06 s), not of all four (0.09 s), a batch that cannot run (they do not fit)
    costs = LayerKVCosts(num_params=1e9, hidden_size=1, kv_dim=8, dtype_bytes=2, flops=2e11,
                         pcie_bandwidth=1e12, decode_base=0.05, decode_per_seq=0.01)
    run = decoding(0.0, 98.0, 21, predicted=121, length_known=True)  # 100 to come, 20 past in 2 s
    held = [decoding(1.0 + k, 99.0, 1, status=OFFLOADED, slo=math.nan, device_layers=0) for k in range(3)]
    view = make_view([run] + held + [waiting(10.0)], free=0)
    policy = LayerKVPolicy(costs=costs, decode_from_host=False)
    assert policy.current_batch(view, np.arange(4)).tolist() == [0]
    assert policy.min_allowed_prefill_time(view) == pytest.approx(0.2 * 120 - (2.0 + 0.06 * 100))
    # nothing running: the step of everyone past prefill is all there is to go by
    idle = make_view([dict(run, status=OFFLOADED)] + held, free=0)
    assert policy.current_batch(idle, np.arange(4)).tolist() == [0, 1, 2, 3]


def test_eq1_current_tpot_decoding_from_the_host_counts_the_link():
    # the three OFFLOADED requests decode in the same step: a step of all four (0.09 s), or
    # the time their host layers (4 of 4, 33 tokens each, 32 bytes a token-layer) take on a
    # link of 1e4 B/s: 3 * 33 * 4 * 32 / 1e4 = 1.2672 s, the longer
    costs = LayerKVCosts(num_params=1e9, hidden_size=1, kv_dim=8, dtype_bytes=2, flops=2e11,
                         pcie_bandwidth=1e12, decode_base=0.05, decode_per_seq=0.01)
    run = decoding(0.0, 98.0, 21, predicted=121, length_known=True)
    held = [decoding(1.0 + k, 99.0, 1, status=OFFLOADED, slo=math.nan, device_layers=0) for k in range(3)]
    view = make_view([run] + held + [waiting(10.0)], free=0)
    policy = LayerKVPolicy(costs=costs)
    assert policy.current_batch(view, np.arange(4)).tolist() == [0, 1, 2, 3]
    assert policy.current_tpot(view, np.arange(4)) == pytest.approx(0.09)
    # on a slow link none of them decodes beside the running one (their reads would not
    # hide under its step), so the batch is that one; decoding all regardless, the link sets it
    slow = dataclasses.replace(costs, pcie_bandwidth=1e4)
    assert LayerKVPolicy(costs=slow).current_batch(view, np.arange(4)).tolist() == [0]
    every = LayerKVPolicy(costs=slow, hide_host_reads=False)
    assert every.current_tpot(view, np.arange(4)) == pytest.approx(3 * 33 * 4 * 32 / 1e4)
    assert every.min_allowed_prefill_time(view) == pytest.approx(0.2 * 120 - (2.0 + 1.2672 * 100))


def test_algorithm1_admits_while_the_summed_prefill_stays_strictly_below():
    # one decoding request without a prediction: T_allow = 0.2 (N_past + 1) - T_past - 0.05;
    # T_past = 0.2 N_past - 1.95 + slack gives T_allow = slack + 2.0 - ... set so that it
    # is exactly 2 s (two 1 s prompts: 2 < 2 fails, Eq. 2 is strict) and a little more
    def admitted(allow: float) -> list[int]:
        t_past = 0.2 * 21 - 0.05 - allow  # N_past 20, N_future 1
        view = make_view([decoding(0.0, 100.0 - t_past, 21)] + [waiting(10.0 + k) for k in range(3)], free=0)
        assert LayerKVPolicy(costs=COSTS).min_allowed_prefill_time(view) == pytest.approx(allow)
        return [s for s in LayerKVPolicy(costs=COSTS).schedule(view).run if s != 0]

    one_s = float(COSTS.prefill_time(100))
    assert admitted(2 * one_s) == [1]
    assert admitted(2 * one_s + 1e-6) == [1, 2]
    assert admitted(0.5) == []
    assert admitted(10.0) == [1, 2, 3]


def test_no_prefill_is_added_for_a_request_already_behind_its_tpot_slo():
    d = [decoding(0.0, 90.0, 11)]  # 10 gaps in 10 s: 1 s per token, SLO 0.2 s
    plan = LayerKVPolicy(costs=COSTS).schedule(make_view(d + [waiting(5.0)], free=0))
    assert 1 not in plan.run and list(plan.run) == [0]  # the decode goes on instead


def test_a_prefill_keeps_the_layers_the_forecast_spares():
    # a running request (no SLO, no prediction: it grows a block a stage for the whole
    # horizon) and 7 whole blocks free: vLLM would not admit a 7-block prompt above its
    # 1-block watermark, so it is offloaded; the forecast's lowest point is 28 - 4 * 4 = 12
    # slots, 8 above the threshold (1 block of 4 slots): it keeps 8 // 7 = 1 layer
    view = make_view([decoding(0.0, 99.0, 1, slo=math.nan), waiting(1.0)], free=7,
                     slots=np.zeros(L, np.int64))
    policy = LayerKVPolicy(costs=COSTS)
    assert policy.spare_slots(view) == 8
    plan = policy.schedule(view)
    assert dict(kept(plan)) == {1: 1} and plan.allocate[1] == 7


def test_decodes_bring_back_offloaded_requests_oldest_first():
    run = decoding(0.0, 90.0, 5)
    old = decoding(1.0, 95.0, 1, status=OFFLOADED, device_layers=0)
    new = decoding(2.0, 96.0, 1, status=OFFLOADED, device_layers=0)
    # 5 whole blocks free: the running one grows 0, the older comes back (3 blocks), the
    # newer (3 more) would leave less than the watermark... it has none with 100 blocks: 1;
    # it decodes with its layers on the host instead (or, with the whole-block return, waits)
    plan = LayerKVPolicy(costs=COSTS).schedule(make_view([run, old, new], free=5))
    assert list(plan.run) == [0, 1, 2] and dict(kept(plan)) == {1: L}
    whole = LayerKVPolicy(costs=COSTS, decode_from_host=False).schedule(make_view([run, old, new], free=5))
    assert list(whole.run) == [0, 1] and dict(kept(whole)) == {1: L}
    both = LayerKVPolicy(costs=COSTS).schedule(make_view([run, old, new], free=7))
    assert list(both.run) == [0, 1, 2] and dict(kept(both)) == {1: L, 2: L}


def test_a_host_decode_takes_its_next_block_in_its_kept_layers_and_on_the_host():
    # 48 tokens computed in 3 blocks, the 49th needs a 4th: keeping 2 of 4 layers it takes a
    # slot in layers 1 and 3 (one whole block split: the 1-block threshold is still met)
    # and host slots in layers 0 and 2
    at_edge = decoding(1.0, 95.0, 17, prompt=32, status=OFFLOADED, device_layers=2, num_blocks=3)
    none = np.zeros(L, np.int64)
    plan = LayerKVPolicy(costs=COSTS).schedule(make_view([at_edge], free=1, slots=none))
    assert plan.run == {0: 1} and plan.allocate == {0: 1} and not kept(plan)
    # no whole block free: Eq. 5's forecast is 4 slots short of its threshold, so the
    # request offloads its retained layers this step (half frees 3, then all) instead of
    # decoding
    plan = LayerKVPolicy(costs=COSTS).schedule(make_view([at_edge], free=0, slots=none))
    assert dict(kept(plan)) == {0: 0} and not plan.run
    # every layer on the host: host slots alone
    on_host = dict(at_edge, device_layers=0)
    plan = LayerKVPolicy(costs=COSTS).schedule(make_view([on_host], free=0, slots=none))
    assert plan.run == {0: 1} and plan.allocate == {0: 1}
    assert not LayerKVPolicy(costs=COSTS).schedule(make_view([on_host], free=0, slots=none, free_host=0)).run


def test_the_forecast_offloads_retained_layers_of_the_newest_first_half_then_all():
    # one running request grows 4 slots a stage for 4 stages; two OFFLOADED ones keep 2 of 4
    # layers of 3 blocks (6 slots each); the threshold is 2 blocks (8 slots) of 200
    running = decoding(0.0, 90.0, 5, prompt=10)
    old = decoding(1.0, 95.0, 1, status=OFFLOADED, device_layers=2)
    new = decoding(2.0, 96.0, 1, status=OFFLOADED, device_layers=2, last_token_time=97.0)
    policy = LayerKVPolicy(costs=COSTS)

    def offloads(free: int) -> tuple[int, dict[int, int]]:
        view = make_view([running, old, new], free=free, num_blocks=200)
        return policy.spare_slots(view, joins=False), policy.offloads(view)

    # 7 free blocks: 28 - 16 = 12 >= 8, nothing to do
    assert offloads(7) == (4, {})
    # 5: 20 - 16 = 4, 4 short: halving the newest (3 slots) is not enough, halving both is
    assert offloads(5) == (-4, {2: 1, 1: 1})
    # 6: exactly at the threshold
    assert offloads(6) == (0, {})
    # 3: 12 short: both halved (6), then the newest emptied (3 more), then the older
    assert offloads(3)[1] == {2: 0, 1: 0}
    assert offloads(4) == (-8, {2: 0, 1: 1})


def test_a_stall_of_the_whole_block_return_offloads_every_retained_layer():
    # nothing runs; the only OFFLOADED request keeps 2 layers and cannot come back whole
    held = decoding(0.0, 95.0, 1, status=OFFLOADED, device_layers=2)
    plan = LayerKVPolicy(costs=COSTS, decode_from_host=False).schedule(make_view([held], free=1))
    assert dict(kept(plan)) == {0: 0} and not plan.run
    # decoding from the host, it is no stall: it decodes as it is
    plan = LayerKVPolicy(costs=COSTS).schedule(make_view([held], free=1))
    assert plan.run == {0: 1} and not kept(plan)


# --------------------------------------------------------------------------- random traces
# Costs in the harness's fake clock (a second per reading, a few per step): Eq. 3 gives
# about 1 s per 10 prompt tokens, and the link is slow enough that short prompts keep
# some layers (x_min > 0) and long ones none.
FAKE_COSTS = LayerKVCosts(num_params=1e9, hidden_size=1, kv_dim=8, dtype_bytes=2, flops=2e8,
                          pcie_bandwidth=2e3, decode_base=1.0)
VARIANTS = {
    "layerkv": LayerKVPolicy(bucket_tokens=4),
    "layerkv-costs": LayerKVPolicy(bucket_tokens=4, costs=FAKE_COSTS),
    "layerkv/SLO": LayerKVPolicy(name="layerkv/SLO", slo_aware=False, bucket_tokens=4, costs=FAKE_COSTS),
    "layerkv-whole": LayerKVPolicy(name="layerkv-whole", decode_from_host=False, bucket_tokens=4, costs=FAKE_COSTS),
}


@pytest.mark.parametrize("name", VARIANTS)
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traces_keep_invariants_and_outputs(name: str, data: st.DataObject) -> None:
    """Layer residencies of every kind under random traces with aborts: the harness checks
    the engine's invariants (slots held once per layer, host slots accounted, nothing held
    by ended requests) and the bookkeeping after every step, and at the end that every
    request produced exactly the tokens it produces alone."""
    cfg = data.draw(configs(), label="config")
    cfg["num_host_blocks"] = data.draw(st.sampled_from([0, cfg["num_blocks"], 4 * cfg["num_blocks"]]))
    num_layers = data.draw(st.sampled_from([1, 2, 3, 5]), label="layers")
    h = Harness(**cfg, policy=VARIANTS[name], num_layers=num_layers)
    h.run(data.draw(specs_for(cfg), label="requests"), data.draw(aborts_strategy(), label="aborts"))
    event(f"partial prefills > 0: {h.runner.num_partial_prefills > 0}")
    event(f"layer moves > 0: {h.runner.num_layer_moves > 0}")


def test_registered_with_its_ablation():
    assert isinstance(POLICIES["layerkv"](), LayerKVPolicy)
    ablation = POLICIES["layerkv/SLO"]()
    assert ablation.name == "layerkv/SLO" and not ablation.slo_aware
    whole = POLICIES["layerkv-whole"]()
    assert whole.name == "layerkv-whole" and not whole.decode_from_host and POLICIES["layerkv"]().decode_from_host
    assert LayerKVPolicy.capabilities.predictor_kind == "s3"


def test_host_decodes_only_while_their_reads_hide_under_the_step():
    # a running request and two OFFLOADED ones (33 tokens, every layer on the host: 33 * 4 *
    # 32 bytes a step); a decode step takes 0.05 s. At 1e6 B/s one read (4.2 ms) hides, two
    # (8.4 ms) too; at 1e5 B/s one takes 42 ms and fits, two do not
    run = decoding(0.0, 90.0, 5)
    held = [decoding(1.0 + k, 95.0, 1, status=OFFLOADED, device_layers=0) for k in range(2)]
    for bandwidth, decoded in ((1e6, [0, 1, 2]), (1e5, [0, 1]), (1e4, [0])):
        costs = dataclasses.replace(COSTS, pcie_bandwidth=bandwidth)
        assert list(LayerKVPolicy(costs=costs).schedule(make_view([run, *held], free=0)).run) == decoded
        every = LayerKVPolicy(costs=costs, hide_host_reads=False).schedule(make_view([run, *held], free=0))
        assert list(every.run) == [0, 1, 2]
