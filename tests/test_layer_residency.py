"""Layer-wise KV residency (LayerKV, its `Plan.features` section): the slot bookkeeping, the plan rules,
and random traces with residencies forced by `layer_offload_policy.ForcedLayerOffload`
through the real engine state and the per-layer fake KV of `policy_harness` (every
request's output equal to its unpreempted run, invariants after every step)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from property_examples import examples
from layer_offload_policy import ForcedLayerOffload
from policy_harness import FakeClock, FakeRunner, Harness, aborts_strategy, configs, spec, specs_for

from jserve.builder import assemble_engine
from jserve.cache.blocks import BlockManager
from jserve.cache.layers import LayerSlab, kept_layers, layer_demand, layer_shortfall
from jserve.cache_features.layer_offload.batch import layer_work
from jserve.cache_features.layer_offload.section import (
    device_layers,
    layer_view,
    num_free_host_layer_blocks,
    num_free_layer_blocks,
    section,
)
from jserve.engine.batch import StepOutput
from jserve.cache_features.swap_tier.section import PreemptMode, preemptions
from jserve.engine.plan import Plan
from jserve.engine.request import RequestStatus
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.view import SchedulerLimits
from jserve.errors import PlanError
from jserve.policies.vllm import VLLMPolicy


def test_kept_layers_spread_evenly_as_the_papers_example():
    assert kept_layers(8, 4) == (1, 3, 5, 7)  # Section 3.1.2: even layers offloaded
    assert kept_layers(8, 8) == tuple(range(8)) and kept_layers(8, 0) == ()
    assert kept_layers(8, 1) == (7,)
    for L in range(1, 12):
        for x in range(L + 1):
            kept = kept_layers(L, x)
            assert len(set(kept)) == x and all(0 <= k < L for k in kept) and list(kept) == sorted(kept)
    with pytest.raises(ValueError):
        kept_layers(4, 5)


def test_slab_splits_whole_blocks_and_merges_them_back():
    blocks = BlockManager(4, 2)
    slab = LayerSlab(blocks, 3)
    a = slab.take(0, 2)
    assert blocks.num_free == 2 and blocks.num_lent == 2
    b = slab.take(1, 2)  # the split blocks' layer-1 slots, no new split
    assert sorted(a) == sorted(b) and blocks.num_lent == 2
    assert slab.free_slots.tolist() == [0, 0, 2]
    slab.check_invariants()
    blocks.check_invariants()
    slab.give(0, a)
    assert blocks.num_lent == 2  # layer 1 still holds them
    slab.give(1, b)
    assert blocks.num_lent == 0 and blocks.num_free == 4 and slab.free_slots.tolist() == [0, 0, 0]
    slab.check_invariants()
    blocks.check_invariants()


def test_layer_shortfall_counts_whole_blocks_for_every_layer():
    assert layer_shortfall(layer_demand(4, 2, 3), np.array([0, 3, 0, 0]), 0) == 3  # layer 3 has none
    assert layer_shortfall(layer_demand(4, 2, 3), np.array([0, 3, 0, 0]), 3) == 0
    assert layer_shortfall(layer_demand(4, 2, 3), np.array([0, 1, 0, 2]), 1) == 1


def _engine(num_blocks=8, block_size=2, num_host_blocks=8, num_layers=4, prefix=None):
    limits = SchedulerLimits(4, 64, 32)
    runner = FakeRunner(num_blocks, block_size, limits, 16, num_layers=num_layers,
                        num_host_blocks=num_host_blocks)
    engine = assemble_engine(VLLMPolicy(), runner, FakeClock(), num_blocks=num_blocks,
                             block_size=block_size, limits=limits, vocab_size=16,
                             num_host_blocks=num_host_blocks, num_layers=num_layers)
    return engine, runner


def _add(engine, rid, n):
    return engine.add_request(rid, [1 + i % 5 for i in range(n)],
                              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def _apply(engine, plan):
    state = engine.state
    state.apply(plan, 0.0)
    batch = state.batch(with_inputs=True)
    out = engine.runner.execute(batch) if batch.num_seqs or batch.moves_blocks else StepOutput.empty()
    state.commit(batch, out, 0.0)
    state.check_invariants()
    return batch


def test_a_prefill_keeping_some_layers_holds_slots_and_host_blocks():
    engine, runner = _engine()
    req = _add(engine, "a", 5)
    s = req.seq_id
    batch = _apply(engine, Plan(run={s: 5}, allocate={s: 3}, features=section({s: 2})))
    state = engine.state
    assert req.status is RequestStatus.OFFLOADED or state.table.data.status[state.live.row(s)] == 4
    view = state.snapshot(0.0)
    assert device_layers(view).tolist() == [2]
    assert num_free_layer_blocks(view) == 4 * 8 - 2 * 3  # 2 kept layers x 3 blocks on the device
    assert num_free_host_layer_blocks(view) == 4 * 8 - 2 * 3
    assert layer_work(batch).traffic.prefill_to_host == (3, 0, 3, 0)  # layers 1, 3 kept
    assert runner.num_partial_prefills == 1
    # It decodes with layers 0 and 2 on the host: their 3 blocks of context read for the
    # step, the block its 6th token lands in written back; it stays OFFLOADED.
    batch = _apply(engine, Plan(run={s: 1}))
    assert layer_work(batch).traffic.to_device == (3, 0, 3, 0)
    assert layer_work(batch).traffic.prefill_to_host == (1, 0, 1, 0)
    assert state.snapshot(0.0).requests.status.tolist() == [RequestStatus.OFFLOADED]
    assert runner.num_host_decodes == 1
    # Its 7th token needs a 4th block: a slot in each kept layer and on the host for the others.
    with pytest.raises(PlanError, match="repeat"):
        state.apply(Plan(run={s: 1}, allocate={s: 1}, repeat=2), 0.0)
    _apply(engine, Plan(run={s: 1}, allocate={s: 1}))
    view = state.snapshot(0.0)
    assert num_free_layer_blocks(view) == 4 * 8 - 2 * 4 and num_free_host_layer_blocks(view) == 4 * 8 - 2 * 4
    batch = _apply(engine, Plan(run={s: 1}, features=section({s: 4}), allocate={}))
    assert layer_work(batch).traffic.to_device == (4, 0, 4, 0)
    assert layer_work(batch).traffic.device_copy == (0, 4, 0, 4)
    view = state.snapshot(0.0)  # that was its 4th and last token: everything is free
    assert view.num_free_blocks == 8 and num_free_host_layer_blocks(view) == 4 * 8


def test_offloading_a_running_request_frees_its_layers_for_others():
    engine, _ = _engine()
    req = _add(engine, "a", 5)
    s = req.seq_id
    _apply(engine, Plan(run={s: 5}, allocate={s: 3}))
    batch = _apply(engine, Plan(features=section({s: 0})))
    assert layer_work(batch).traffic.to_host == (3, 3, 3, 3)
    view = engine.state.snapshot(0.0)
    assert view.num_free_blocks == 8 and view.requests.status.tolist() == [RequestStatus.OFFLOADED]
    batch = _apply(engine, Plan(features=section({s: 1})))  # one layer back, into slots
    assert layer_work(batch).traffic.to_device == (0, 0, 0, 3)
    assert num_free_layer_blocks(engine.state.snapshot(0.0)) == 4 * 8 - 3
    _apply(engine, Plan(run={s: 1}, features=section({s: 4})))


@pytest.mark.parametrize("plan, match", [
    (lambda s: Plan(run={s: 5}, allocate={s: 3}, features=section({s: 5})), "cannot keep 5 of 4"),
    (lambda s: Plan(features=section({s: 1})), "only in the plan that prefills it"),
    (lambda s: Plan(run={s: 5}, allocate={s: 3}, features=section({s: 4}), repeat=2), "cannot repeat"),
    (lambda s: Plan(run={s: 5}, allocate={s: 3}, features=section({s: 0})), "host layer slots"),
])
def test_plans_the_state_cannot_honour_are_refused(plan, match):
    engine, _ = _engine(num_host_blocks=2)
    req = _add(engine, "a", 5)
    with pytest.raises(PlanError, match=match):
        engine.state.apply(plan(req.seq_id), 0.0)
    engine.state.check_invariants()


def test_layer_offload_needs_a_host_tier_and_no_swap_of_a_partial_request():
    engine, _ = _engine(num_host_blocks=0)
    s = _add(engine, "a", 5).seq_id
    with pytest.raises(PlanError, match="host KV tier"):
        engine.state.apply(Plan(run={s: 5}, allocate={s: 3}, features=section({s: 1})), 0.0)
    engine, _ = _engine()
    s = _add(engine, "a", 5).seq_id
    _apply(engine, Plan(run={s: 5}, allocate={s: 3}, features=section({s: 1})))
    with pytest.raises(PlanError, match="recompute"):
        engine.state.apply(Plan(**preemptions({s: PreemptMode.SWAP})), 0.0)
    _apply(engine, Plan(preempt=[s]))
    view = engine.state.snapshot(0.0)
    assert view.num_free_blocks == 8 and num_free_host_layer_blocks(view) == 4 * 8
    assert device_layers(view).tolist() == [4]


def _keep_all_offloaded(seq: int, num_layers: int) -> int:
    return 0


def _keep_mixed(seq: int, num_layers: int) -> int:
    return seq % (num_layers + 1)


POLICIES = {
    "all-offloaded": ForcedLayerOffload(keep=_keep_all_offloaded),
    "mixed": ForcedLayerOffload(keep=_keep_mixed, reshuffle=True),
    "mixed-offload-running": ForcedLayerOffload(keep=_keep_mixed, offload_running=True, reshuffle=True),
    "host-decodes": ForcedLayerOffload(keep=_keep_mixed, offload_running=True, reshuffle=True, host_decodes=True),
}


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traces_with_layer_residencies(name, data):
    cfg = data.draw(configs())
    cfg["num_host_blocks"] = data.draw(st.sampled_from([cfg["num_blocks"], 2 * cfg["num_blocks"]]))
    num_layers = data.draw(st.sampled_from([1, 2, 3, 5]))
    h = Harness(**cfg, policy=POLICIES[name], num_layers=num_layers)
    h.run(data.draw(specs_for(cfg)), data.draw(aborts_strategy()))
    event(f"partial prefills > 0: {h.runner.num_partial_prefills > 0}")
    event(f"layer moves > 0: {h.runner.num_layer_moves > 0}")
    event(f"host decodes > 0: {h.runner.num_host_decodes > 0}")


def test_a_hand_trace_moves_layers_every_way():
    cfg = dict(num_blocks=12, block_size=2, eos=None, vocab_size=16,
               limits=SchedulerLimits(4, 32, 32), num_host_blocks=24)
    h = Harness(**cfg, policy=POLICIES["mixed-offload-running"], num_layers=4)
    h.run([spec(7, 6, arrive=k, first=k) for k in range(5)])
    assert h.runner.num_partial_prefills and h.runner.num_layer_moves
    h = Harness(**cfg, policy=POLICIES["host-decodes"], num_layers=4)
    h.run([spec(7, 6, arrive=k, first=k) for k in range(6)])
    assert h.runner.num_host_decodes and h.runner.num_layer_moves


def test_the_simulator_runs_forced_residencies_and_hands_layer_bytes_to_the_cost_model():
    from jserve.builder import build_engine
    from jserve.config import EngineConfig

    built = build_engine(EngineConfig(runner="sim", model="llama-2-7b", hardware="l20",
                                      num_blocks=64, max_model_len=512, swap_space=1.0))
    engine = built.engine
    engine.policy = ForcedLayerOffload(keep=_keep_mixed)
    shapes = []
    cost = engine.runner.cost_model
    engine.runner.cost_model = type("Spy", (), {"step_time": lambda self, s: shapes.append(s) or cost.step_time(s)})()
    for k in range(6):
        engine.add_request(f"r{k}", [1] * (100 + 50 * k),
                           SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), arrival_time=0.0)
    while engine.has_unfinished:
        engine.step()
        engine.state.check_invariants()
    moved = [s.layer_bytes for s in shapes if s.layer_bytes is not None]
    assert moved and any(sum(m.prefill_to_host) for m in moved) and any(sum(m.to_device) for m in moved)
    per_layer_block = 2 * 128 * 32 * 16 * 2  # K and V, 32 heads x 128, 16 tokens, bf16
    assert all(b % per_layer_block == 0 for m in moved for b in m.prefill_to_host)


def test_layer_offload_and_a_prefix_cache_are_refused_together():
    from jserve.cache.prefix import PrefixCacheConfig
    from jserve.config import EngineConfig

    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(runner="sim", model="llama-2-7b", policy=ForcedLayerOffload(),
                     prefix_cache=PrefixCacheConfig())


def test_getting_every_layer_back_reuses_the_blocks_its_slots_free():
    """A request keeping 2 of 4 layers in 3 split blocks comes back whole with one whole
    block free: its own blocks merge back when their slots are released, before the take."""
    engine, _ = _engine(num_blocks=4)
    s = _add(engine, "a", 5).seq_id
    _apply(engine, Plan(run={s: 5}, allocate={s: 3}, features=section({s: 2})))
    view = engine.state.snapshot(0.0)
    assert view.num_free_blocks == 1 and layer_view(view).free_slots.tolist() == [3, 0, 3, 0]
    batch = _apply(engine, Plan(run={s: 1}, allocate={s: 1}, features=section({s: 4})))
    assert layer_work(batch).traffic.device_copy == (0, 3, 0, 3)
    assert engine.state.snapshot(0.0).num_free_blocks == 0


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_plans_are_refused_whole_or_applied_whole(data):
    """Random residency plans (offloads, bring-backs, partial prefills, decodes, recompute
    preemptions) straight at the state, often past its room: a plan the checker passes
    always applies (no take fails half way), one it refuses changes nothing, and the fake
    per-layer KV stays right."""
    L = data.draw(st.integers(1, 4))
    num_blocks, bs = data.draw(st.integers(4, 10)), data.draw(st.integers(1, 2))
    engine, _ = _engine(num_blocks=num_blocks, block_size=bs, num_layers=L,
                        num_host_blocks=data.draw(st.integers(0, 12)))
    state = engine.state
    for k in range(data.draw(st.integers(1, 5))):
        _add(engine, f"r{k}", data.draw(st.integers(1, 3 * bs)))
    for _ in range(data.draw(st.integers(1, 12))):
        view = state.snapshot(0.0)
        r = view.requests
        run, allocate, layers, preempt = {}, {}, {}, []
        for i in data.draw(st.permutations(range(len(r)))):
            seq, status = int(r.seq_id[i]), int(r.status[i])
            choice = data.draw(st.sampled_from(["none", "run", "layers", "preempt"]))
            need = view.blocks_for(int(r.num_computed[i]) + 1 if status != 0 else int(r.num_tokens[i]))
            grow = max(0, need - int(r.num_blocks[i])) + data.draw(st.integers(0, 1))
            if choice == "run" and status in (0, 1, 4):
                run[seq] = int(r.num_tokens[i] - r.num_computed[i])
                allocate[seq] = grow
                if status == 4 or data.draw(st.booleans()):
                    layers[seq] = data.draw(st.integers(0, L))
            elif choice == "layers" and status in (1, 4):
                layers[seq] = data.draw(st.integers(0, L))
            elif choice == "preempt" and status in (1, 4):
                preempt.append(seq)
        plan = Plan(run=run, allocate=allocate, features=section(layers), preempt=preempt)
        before = (state.snapshot(0.0).requests.status.tobytes(), state.blocks.num_free,
                  state.feature("layer_offload").residency.slab.used.tobytes(), state.feature("layer_offload").residency.free_slots().tobytes())
        try:
            state.apply(plan, 0.0)
        except PlanError as e:
            event(f"refused: {str(e).split(':')[-1][:40]}")
            after = (state.snapshot(0.0).requests.status.tobytes(), state.blocks.num_free,
                     state.feature("layer_offload").residency.slab.used.tobytes(), state.feature("layer_offload").residency.free_slots().tobytes())
            assert after == before, f"a refused plan changed the state: {e}"
            state.check_invariants()
            continue
        batch = state.batch(with_inputs=True)
        out = engine.runner.execute(batch) if batch.num_seqs or batch.moves_blocks else StepOutput.empty()
        state.commit(batch, out, 0.0)
        state.check_invariants()
        if not state.has_unfinished:
            break
