"""Swap preemption's bookkeeping: plans the state refuses, what a swap does to the columns
and both tiers, and the simulator charging the transfer. (Outputs staying identical under
swaps: test_engine_greedy.py and the vllm-swap property tests.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from policy_harness import FakeClock, FakeRunner

from jserve.builder import assemble_engine
from jserve.cache_features.swap_tier.section import PreemptMode, Swaps, preempt_modes, preemptions, swaps
from jserve.engine.batch import Batch, StepOutput
from jserve.engine.plan import Plan
from jserve.engine.request import RequestStatus
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.state import EngineState
from jserve.engine.view import SchedulerLimits
from jserve.errors import PlanError
from jserve.policies.vllm import VLLMPolicy
from jserve.runners.cost_model import RooflineCostModel, StepShape
from jserve.runners.hardware import get_hardware
from jserve.models.registry import get_config

LIMITS = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16)


def batch_output(batch: Batch) -> StepOutput:
    return StepOutput(np.ones(batch.num_seqs, np.int32), np.zeros(batch.num_seqs, np.float32))


def _two_running(num_host_blocks: int) -> tuple[EngineState, int, int]:
    engine = assemble_engine(VLLMPolicy(), FakeRunner(6, 4, LIMITS, 16), FakeClock(), num_blocks=6,
                             block_size=4, limits=LIMITS, vocab_size=16,
                             num_host_blocks=num_host_blocks)
    state = engine.state
    for rid in "ab":
        engine.add_request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    a, b = state.snapshot(0.0).requests.seq_id.tolist()
    return state, a, b


def test_swap_needs_a_host_tier_with_room() -> None:
    state, a, _ = _two_running(num_host_blocks=0)
    with pytest.raises(PlanError, match="needs a host KV tier"):
        state.apply(Plan(**preemptions({a: PreemptMode.SWAP})), 0.0)
    state, a, b = _two_running(num_host_blocks=3)
    with pytest.raises(PlanError, match="swaps out 4 blocks, 3 free on the host"):
        state.apply(Plan(**preemptions({a: PreemptMode.SWAP, b: PreemptMode.SWAP})), 0.0)
    state.check_invariants()


def test_swap_out_and_in_moves_blocks_between_tiers() -> None:
    state, a, b = _two_running(num_host_blocks=8)
    held = state.blocks.table(a)
    state.apply(Plan(**preemptions({a: PreemptMode.SWAP})), 1.0)
    batch = state.batch()
    assert [m.seq_id for m in batch.swap_out] == [a] and list(batch.swap_out[0].device_blocks) == held
    view = state.snapshot(1.0)
    row = view.requests.seq_id.tolist().index(a)
    assert view.requests.status[row] == RequestStatus.SWAPPED
    assert view.requests.num_computed[row] == 5 and view.requests.num_host_blocks[row] == 2
    assert view.num_free_host_blocks == 6
    state.commit(batch, batch_output(batch), 1.0)
    state.check_invariants()

    with pytest.raises(PlanError, match="swap it in before running it"):
        state.apply(Plan(run={a: 1}), 2.0)
    with pytest.raises(PlanError, match="only swapped requests can be swapped in"):
        state.apply(Plan(**preemptions({}, {b})), 2.0)
    state.apply(Plan(run={a: 1, b: 1}, **preemptions({}, {a})), 2.0)
    batch = state.batch()
    assert [m.seq_id for m in batch.swap_in] == [a] and len(batch.swap_in[0].device_blocks) == 2
    assert state.host_blocks.num_free == 8
    state.commit(batch, batch_output(batch), 2.0)
    state.check_invariants()


def test_abort_while_swapped_frees_the_host_and_tells_the_runner() -> None:
    state, a, _ = _two_running(num_host_blocks=8)
    state.apply(Plan(**preemptions({a: PreemptMode.SWAP})), 1.0)
    state.commit(state.batch(), batch_output(state.batch()), 1.0)
    state.abort("a", 2.0)
    assert state.host_blocks.num_free == 8
    state.apply(Plan(), 3.0)
    assert state.batch().host_dropped == (a,)
    state.check_invariants()


def test_simulator_charges_both_directions_and_every_copy() -> None:
    """The swap-out step and the swap-in step each wait for their request's blocks: bytes
    over the link plus one copy per block, layer and K/V (vLLM v0)."""
    cfg, hw = get_config("opt-13b"), get_hardware("a100-80g")
    cost = RooflineCostModel(cfg, hw)
    bytes_per_block = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 2
    per_direction = 2 * bytes_per_block / hw.pcie_bandwidth + 2 * 2 * cfg.num_layers * hw.copy_latency
    state, a, _ = _two_running(num_host_blocks=8)
    state.apply(Plan(**preemptions({a: PreemptMode.SWAP})), 1.0)
    out = state.batch()
    shape = StepShape.of(out, bytes_per_block=bytes_per_block)
    assert (shape.swap_bytes, shape.swap_blocks, shape.swap_moves) == (2 * bytes_per_block, 2, 1)
    assert cost.step_time(dataclasses.replace(shape, num_seqs=0, num_decode_tokens=0, attended=0,
                                              kv_read_tokens=0)) == pytest.approx(per_direction)
    assert cost.step_time(shape) == pytest.approx(
        cost.step_time(dataclasses.replace(shape, swap_bytes=0, swap_blocks=0, swap_moves=0)) + per_direction)
    state.commit(out, batch_output(out), 1.0)
    state.apply(Plan(run={a: 1}, **preemptions({}, {a})), 2.0)
    back = StepShape.of(state.batch(), bytes_per_block=bytes_per_block)
    assert (back.swap_bytes, back.swap_blocks, back.swap_moves) == (2 * bytes_per_block, 2, 1)


def test_preemption_is_measured_through_the_runners_own_paths(tiny_loaded) -> None:
    """Recompute = a prefill step, swap = the host store's out and back in, on the real
    runner; every swapped request comes back (the host store ends empty)."""
    from jserve.builder import build_engine
    from jserve.config import EngineConfig
    from jserve.runners.profiling import measure_preemption

    config = EngineConfig(model=tiny_loaded, num_blocks=16, block_size=4, max_model_len=16,
                          max_num_seqs=4, max_num_batched_tokens=16, warmup=False)
    runner = build_engine(config).runner
    profile = measure_preemption(runner, [4, 4, 8, 8], repeats=1)
    assert profile.sizes == (4, 4, 8, 8) and min(profile.recompute_s + profile.swap_s) > 0
    assert len(runner.host_kv) == 0
    assert profile.fit().solve().kind in ("crossing", "always", "never")


def test_a_plan_names_victims_and_the_swap_tier_says_which_go_to_the_host() -> None:
    with pytest.raises(TypeError, match="swap tier's section"):
        Plan(preempt={1: PreemptMode.SWAP})
    with pytest.raises(ValueError, match="names a request twice"):
        Plan(preempt=[1, 1])
    modes = {3: PreemptMode.SWAP, 1: PreemptMode.RECOMPUTE}
    plan = Plan(**preemptions(modes, {7}))
    assert plan.preempt == (3, 1) and swaps(plan) == Swaps(out={3}, back={7})
    assert preempt_modes(plan) == modes and list(preempt_modes(plan)) == [3, 1]
    assert Plan(**preemptions({1: PreemptMode.RECOMPUTE})).features == {}
    state, a, b = _two_running(num_host_blocks=8)
    with pytest.raises(PlanError, match=f"seq {a}: swapped out, and the plan does not preempt it"):
        state.apply(Plan(preempt=[b], features={"swap_tier": Swaps(out={a})}), 0.0)
    state.check_invariants()
