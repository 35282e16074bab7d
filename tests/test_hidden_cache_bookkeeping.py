"""Apt-Serve's hidden cache in the engine's bookkeeping: random traces with both cache types
and type switches (`hidden_cache_policy.ForcedHiddenCache`) through the real
EngineState/Engine loop and the fake paged runner of `policy_harness`, which lays a hidden
sequence's tokens `hidden_block_tokens` to a block, so a block count or table wrong for
the type changes the outputs; invariants after every step; and the plan checker's
refusals, each with its reason."""

from __future__ import annotations

import numpy as np
import pytest
from hidden_cache_policy import ForcedHiddenCache, all_hidden, every_other
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from property_examples import examples
from policy_harness import Harness, aborts_strategy, configs, spec, specs_for

from jserve.cache_features.hidden_cache.batch import hidden_mask
from jserve.engine.batch import StepOutput
from jserve.cache_features.hidden_cache.section import (
    COLUMN,
    CacheType,
    blocks_for_type,
    cache_types,
    hidden_view,
    section,
)
from jserve.cache_features.layer_offload.section import section as layer_section
from jserve.cache_features.swap_tier.section import PreemptMode, preemptions
from jserve.engine.plan import Plan
from jserve.engine.view import SchedulerLimits
from jserve.errors import PlanError
from jserve.policies.vllm import VLLMPolicy

POLICIES = {
    "all-hidden": ForcedHiddenCache(all_hidden),
    "mixed": ForcedHiddenCache(every_other),
    "mixed-switching": ForcedHiddenCache(every_other, switch=True),
    "kv-switching": ForcedHiddenCache(lambda seq: CacheType.KV, switch=True),
}


@pytest.mark.parametrize("name", list(POLICIES))
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traces_with_both_types(name: str, data: st.DataObject) -> None:
    cfg = data.draw(configs(block_sizes=st.integers(1, 16), hidden=True), label="config")
    specs = data.draw(specs_for(cfg), label="requests")
    h = Harness(**cfg, policy=POLICIES[name])
    kinds: dict[int, bool] = {}  # seq -> whether it last ran hidden
    changes = 0
    execute = h.runner.execute

    def watching(batch):
        nonlocal changes
        mask = hidden_mask(batch)
        hidden = np.zeros(batch.num_seqs, bool) if mask is None else mask
        for seq, kind in zip(batch.seq_ids.tolist(), hidden.tolist()):
            changes += kinds.setdefault(seq, kind) != kind
            kinds[seq] = kind
        return execute(batch)

    h.runner.execute = watching
    h.run(specs, data.draw(aborts_strategy(), label="aborts"))
    event(f"hidden runs: {h.runner.num_hidden_runs > 0}")
    event(f"preempted: {h.engine.stats.num_preemptions > 0}")
    event(f"a request ran in both types: {changes > 0}")


def test_mha_hidden_requests_take_half_the_blocks() -> None:
    """Hidden blocks hold twice the tokens on an MHA shape: a 17-token prompt takes 2 KV
    blocks of 16, or 1 hidden block (32 tokens); a switch re-prefills everything it has
    (17 prompt + 2 output tokens) in the new type."""
    h = Harness(num_blocks=8, block_size=16, limits=SchedulerLimits(4, 64, 64), eos=None,
                hidden_block_tokens=32, policy=ForcedHiddenCache(every_other, switch=True))
    h.run([spec(17, 4), spec(17, 4)])
    first = h.policy.plans[0]
    assert cache_types(first) == {0: CacheType.KV, 1: CacheType.HIDDEN}
    assert dict(first.allocate) == {0: 2, 1: 1}
    switches = [p for p in h.policy.plans[1:] if cache_types(p)]
    assert switches and all(p.run[s] == 19 for p in switches for s in cache_types(p))


def _one_request(hidden_block_tokens: int = 32, **kw: int) -> Harness:
    h = Harness(num_blocks=8, block_size=16, limits=SchedulerLimits(4, 64, 64), eos=None,
                hidden_block_tokens=hidden_block_tokens, policy=VLLMPolicy(), **kw)
    h.add("a", spec(17, 8))
    return h


def _step(h: Harness, plan: Plan) -> None:
    """Apply `plan` and run its batch through the fake runner (which reads every token back
    through the table, laid out by type); invariants after."""
    h.state.apply(plan, h.clock())
    batch = h.state.batch()
    out = h.runner.execute(batch) if batch.num_seqs else StepOutput.empty()
    h.state.commit(batch, out, h.clock())
    h.state.check_invariants()


def test_switch_discards_and_recomputes_in_the_same_plan() -> None:
    h = _one_request()
    state = h.state
    with pytest.raises(PlanError, match="unknown cache type"):
        state.apply(Plan(features=section({0: 2})), 0.0)
    _step(h, Plan(run={0: 17}, allocate={0: 1}, features=section({0: CacheType.HIDDEN})))  # 17 tokens, 1 block
    assert state.blocks.num_free == 7
    with pytest.raises(PlanError, match="switches cache type while running"):
        state.apply(Plan(features=section({0: CacheType.KV})), 0.0)
    with pytest.raises(PlanError, match="holds 1 blocks, needs 2 for 18 tokens"):
        state.apply(Plan(run={0: 18}, allocate={0: 1}, features=section({0: CacheType.KV})), 0.0)
    with pytest.raises(PlanError, match="cannot run 19 tokens with 0 of 18 computed"):
        state.apply(Plan(run={0: 19}, allocate={0: 2}, features=section({0: CacheType.KV})), 0.0)
    # Its hidden block is released first and the 18 tokens recomputed into 2 KV blocks.
    state.apply(Plan(run={0: 18}, allocate={0: 2}, features=section({0: CacheType.KV})), h.clock())
    batch = state.batch()
    assert hidden_mask(batch) is None and int(batch.start[0]) == 0 and int(batch.query_lens[0]) == 18
    state.commit(batch, h.runner.execute(batch), h.clock())
    state.check_invariants()
    assert state.blocks.num_free == 6
    assert state.requests[0].metrics.num_preemptions == 0


def test_hidden_is_refused_where_unnatural() -> None:
    state = _one_request(hidden_block_tokens=0).state
    with pytest.raises(PlanError, match="holds no hidden row"):
        state.apply(Plan(run={0: 17}, allocate={0: 2}, features=section({0: CacheType.HIDDEN})), 0.0)
    h = _one_request(num_host_blocks=8)
    _step(h, Plan(run={0: 17}, allocate={0: 1}, features=section({0: CacheType.HIDDEN})))
    with pytest.raises(PlanError, match="swap_tier and hidden_cache cache features cannot both hold it"):
        h.state.apply(Plan(**preemptions({0: PreemptMode.SWAP})), 0.0)
    with pytest.raises(PlanError, match="layer_offload and hidden_cache cache features cannot both hold it"):
        h.state.apply(Plan(features=layer_section({0: 0})), 0.0)
    # preempted by recompute, it may come back as KV
    _step(h, Plan(preempt=[0], features=section({0: CacheType.KV})))
    _step(h, Plan(run={0: 18}, allocate={0: 2}))
    assert h.state.live.table.columns[COLUMN][h.state.live.row(0)] == CacheType.KV


def test_view_counts_blocks_by_type() -> None:
    view = _one_request(hidden_block_tokens=10).state.snapshot(0.0)
    assert (hidden_view(view).block_tokens, view.block_size) == (10, 16)
    assert blocks_for_type(view, 17, 1) == 2 and blocks_for_type(view, 17, 0) == 2
    assert blocks_for_type(view, 21, 1) == 3
    assert blocks_for_type(view, np.array([16, 17, 21]), np.array([0, 0, 1])).tolist() == [1, 2, 3]
    assert hidden_view(_one_request(hidden_block_tokens=0).state.snapshot(0.0)).block_tokens == 0
