"""VLLMPolicy on the real EngineState/Engine loop with the fake runner of `policy_harness`:
the vLLM-specific checks (FCFS whole-prompt admission, prefill steps without decodes,
latest-arrival recompute preemption, running requests one decode behind) on random traces,
and hand-picked cases. The generic invariants for every registered policy, vLLM included,
are in `test_policy_properties.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from property_examples import examples
from policy_harness import (
    FakeClock,
    FakeRunner,
    Spec,
    aborts_strategy,
    assert_view_unchanged,
    configs,
    copy_arrays,
    spec,
    specs_for,
    view_scalars,
)
from policy_harness import Harness as BaseHarness

from jserve.builder import assemble_engine
from jserve.engine.batch import StepOutput
from jserve.cache_features.swap_tier.section import swaps
from jserve.engine.plan import Plan
from jserve.engine.request import RequestStatus
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.state import EngineState
from jserve.engine.view import SchedulerLimits, SchedulerView
from jserve.errors import InvalidRequestError, PlanError
from jserve.policies.vllm import VLLMPolicy


# --------------------------------------------------------------------------- vLLM checks
def check_vllm_plan(view: SchedulerView, plan: Plan) -> None:
    """FCFS whole-prompt admission with no decodes beside it; otherwise decodes of every
    running request, victims the latest arrivals."""
    r, lim = view.requests, view.limits
    row = {int(s): i for i, s in enumerate(r.seq_id)}
    waiting = [int(r.seq_id[i]) for i in r.with_status(RequestStatus.WAITING)]
    running = [int(r.seq_id[i]) for i in r.with_status(RequestStatus.RUNNING)]
    assert len(plan.run) <= lim.max_num_seqs
    assert plan.num_batched_tokens <= lim.max_num_batched_tokens
    assert sum(plan.allocate.values()) <= view.num_free_blocks + sum(int(r.num_blocks[row[s]]) for s in plan.preempt)
    assert all(n >= 1 for n in plan.run.values())
    assert all(n >= 0 for n in plan.allocate.values())
    if any(s in waiting for s in plan.run):
        # A prefill step: a prefix of the waiting queue in arrival order, whole prompts, no decodes.
        assert list(plan.run) == waiting[: len(plan.run)], "admission is not FCFS"
        assert not plan.preempt
        assert len(running) + len(plan.run) <= lim.max_num_seqs
        for s in plan.run:
            i = row[s]
            assert plan.run[s] == r.num_tokens[i] - r.num_computed[i]
    else:
        assert set(plan.run) | set(plan.preempt) <= set(running)
        assert all(plan.run[s] == 1 for s in plan.run)
        assert not swaps(plan).out
        # Victims are the latest arrivals: every preempted request arrived after every one that runs.
        if plan.run and plan.preempt:
            last_run = max(r.arrival_time[row[s]] for s in plan.run)
            assert all(r.arrival_time[row[s]] > last_run for s in plan.preempt), "preempted an earlier arrival"
        # Nothing running is silently dropped.
        assert set(plan.run) | set(plan.preempt) == set(running)


def check_vllm_state(h: BaseHarness) -> None:
    """Between steps every running request is exactly one decode behind, holding no spare
    block, and no more run than `max_num_seqs`."""
    bm = h.state.blocks
    r = h.state.snapshot(h.clock.t).requests
    for i in range(len(r)):
        if r.status[i] == RequestStatus.RUNNING:
            assert r.num_computed[i] == r.num_tokens[i] - 1, "a running request is not one decode behind"
            assert r.num_blocks[i] == bm.blocks_for(int(r.num_computed[i])), "running request holds spare blocks"
    assert int((r.status == RequestStatus.RUNNING).sum()) <= h.limits.max_num_seqs


class Harness(BaseHarness):
    """The generic harness running VLLMPolicy with the vLLM-specific checks."""

    def __init__(self, num_blocks: int, block_size: int, limits: SchedulerLimits, eos: int | None,
                 vocab_size: int = 32, num_host_blocks: int = 0, policy: VLLMPolicy | None = None) -> None:
        policy = policy or VLLMPolicy()
        checks = (check_vllm_plan,) if policy.max_paddings is None else (check_vllm_plan, padding_check(policy))
        super().__init__(
            num_blocks=num_blocks, block_size=block_size, limits=limits, eos=eos, vocab_size=vocab_size,
            policy=policy, plan_checks=checks, state_checks=(check_vllm_state,),
            num_host_blocks=num_host_blocks,
        )


def padding_check(policy: VLLMPolicy):
    """vLLM 0.2.3's prompt batching: padded to the longest prompt, the batch fits the token
    budget and holds at most `max_paddings` padding tokens."""

    def check(view: SchedulerView, plan: Plan) -> None:
        r = view.requests
        waiting = set(int(s) for s in r.seq_id[r.with_status(RequestStatus.WAITING)])
        prompts = [n for s, n in plan.run.items() if s in waiting]
        if len(prompts) > 1:
            padded = len(prompts) * max(prompts)
            assert padded <= view.limits.max_num_batched_tokens
            assert padded - sum(prompts) <= policy.max_paddings

    return check


# --------------------------------------------------------------------------- random traces
PROPERTY = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(data=st.data())
def test_random_traces_keep_invariants_and_outputs(data: st.DataObject) -> None:
    cfg = data.draw(configs(), label="config")
    specs = data.draw(specs_for(cfg), label="requests")
    h = Harness(**cfg)
    h.run(specs)
    event(f"preempted: {h.engine.stats.num_preemptions > 0}")


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_padded_prompt_batches_keep_invariants(data: st.DataObject) -> None:
    """`vllm-0.2.3`: the same checks, and every prompt batch within its padding limits."""
    cfg = data.draw(configs(), label="config")
    specs = data.draw(specs_for(cfg), label="requests")
    paddings = data.draw(st.integers(0, 8), label="max_paddings")
    h = Harness(**cfg, policy=VLLMPolicy(max_paddings=paddings))
    h.run(specs)


@PROPERTY
@given(data=st.data())
def test_random_aborts_free_blocks_and_end_requests(data: st.DataObject) -> None:
    cfg = data.draw(configs(), label="config")
    specs = data.draw(specs_for(cfg), label="requests")
    aborts = data.draw(aborts_strategy())
    h = Harness(**cfg)
    h.run(specs, aborts)
    event(f"aborted: {len(h.aborted)}")


# --------------------------------------------------------------------------- hand-picked cases
def test_tight_cache_preempts_and_recompute_keeps_outputs() -> None:
    h = Harness(num_blocks=4, block_size=2, limits=SchedulerLimits(4, 16, 16), eos=None)
    h.run([spec(2, 6, first=i) for i in range(4)])
    assert h.engine.stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in h.final.values()) == h.engine.stats.num_preemptions
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in h.final.values())


def test_length_capped_by_whole_cache() -> None:
    """A request cannot outgrow the KV cache: it ends with 'length' at capacity."""
    h = Harness(num_blocks=2, block_size=2, limits=SchedulerLimits(2, 64, 64), eos=None)
    h.run([spec(3, 40), spec(1, 40, first=3)])
    assert all(len(o.prompt_token_ids) + len(o.token_ids) <= 4 for o in h.final.values())
    assert {o.finish_reason for o in h.final.values()} == {"length"}


def test_eos_stops_unless_ignored() -> None:
    # vocab_size 2: eos (=0) comes up quickly.
    h = Harness(num_blocks=16, block_size=4, limits=SchedulerLimits(4, 32, 32), eos=0, vocab_size=2)
    specs = [Spec([1, 1, 0], 20, ignore_eos=ie, arrive_step=0) for ie in (False, True, False, True)]
    h.run(specs)
    reasons = {rid: o.finish_reason for rid, o in h.final.items()}
    assert reasons["r1"] == reasons["r3"] == "length"
    assert "stop" in (reasons["r0"], reasons["r2"])


def test_more_requests_than_table_rows() -> None:
    """300 live requests at once grow the request table past its initial 256 rows."""
    h = Harness(num_blocks=400, block_size=1, limits=SchedulerLimits(64, 64, 8), eos=None)
    h.run([spec(1 + i % 3, 1 + i % 4, first=i) for i in range(300)])
    assert len(h.final) == 300


def test_invalid_requests_refused_without_side_effects() -> None:
    h = Harness(num_blocks=3, block_size=2, limits=SchedulerLimits(4, 8, 8), eos=None, vocab_size=10)
    assert h.add("ok", spec(2, 3))
    h.step()
    # Too long for the context (8), and too long for the cache (6 slots).
    for rid, plen in [("ctx", 8), ("ctx2", 30), ("cache", 6), ("cache2", 7)]:
        assert not h.add(rid, spec(plen, 1))
    before = h.fingerprint()
    bad = [
        ("ok", [1], SamplingParams()),  # duplicate id
        ("empty", [], SamplingParams()),
        ("vocab", [1, 10], SamplingParams()),
        ("neg", [-1], SamplingParams()),
        ("params", [1], {"max_tokens": 3}),
    ]
    for rid, prompt, params in bad:
        with pytest.raises(InvalidRequestError):
            h.engine.add_request(rid, prompt, params)  # type: ignore[arg-type]
        assert h.fingerprint() == before
        h.check()
    # A refused id stays usable.
    assert h.add("ctx", spec(5, 1))
    while h.engine.has_unfinished:
        h.step()


def _running_state(arrivals: list[float], num_blocks: int, block_size: int, plen: int) -> tuple[EngineState, list[int]]:
    state = EngineState(
        num_blocks=num_blocks, block_size=block_size, limits=SchedulerLimits(8, 64, 64),
        eos_token_id=None, vocab_size=16,
    )
    seqs = [
        state.add(f"r{i}", [1] * plen, SamplingParams(max_tokens=32, ignore_eos=True), t).seq_id
        for i, t in enumerate(arrivals)
    ]
    runner = FakeRunner(num_blocks, block_size, state.limits, 16)
    view = state.snapshot(10.0)
    plan = VLLMPolicy().schedule(view)
    assert set(plan.run) == set(seqs)  # all admitted in one prefill step
    state.apply(plan, 10.0)
    batch = state.batch()
    state.commit(batch, runner.execute(batch), 11.0)
    state.check_invariants()
    return state, seqs


def test_preempts_latest_arrival_not_highest_seq_id() -> None:
    # seq ids 0, 1, 2 arrive at 5, 1, 3: FCFS order is 1, 2, 0; seq 0 is the latest arrival.
    # Each holds one full block (prompt 2, block size 2) and has 3 tokens: the decode of each
    # needs a second block, and only one is free.
    state, seqs = _running_state([5.0, 1.0, 3.0], num_blocks=4, block_size=2, plen=2)
    plan = VLLMPolicy().schedule(state.snapshot(12.0))
    assert plan.preempt == (seqs[0],) and not swaps(plan).out
    assert list(plan.run) == [seqs[1], seqs[2]]
    assert dict(plan.allocate) == {seqs[1]: 1, seqs[2]: 1}
    state.apply(plan, 12.0)
    state.check_invariants()
    r = state.snapshot(13.0).requests
    (i0,) = np.flatnonzero(r.seq_id == seqs[0])
    assert r.status[i0] == RequestStatus.WAITING and r.num_blocks[i0] == 0 and r.num_preemptions[i0] == 1


def test_preempts_latest_arrivals_first_then_itself() -> None:
    # Three requests, 3 blocks, none free: the oldest evicts the latest; the middle one,
    # finding nobody later to evict and no block, preempts itself.
    state, seqs = _running_state([1.0, 2.0, 3.0], num_blocks=3, block_size=2, plen=2)
    plan = VLLMPolicy().schedule(state.snapshot(12.0))
    assert list(plan.preempt) == [seqs[2], seqs[1]]
    assert list(plan.run) == [seqs[0]]
    state.apply(plan, 12.0)
    state.check_invariants()


def test_preempted_requests_are_readmitted_in_arrival_order() -> None:
    # 3 blocks of 2, three prompts of 2: all admitted; at the first decode r0 evicts r2 (latest)
    # and r1, left with no block and nobody later to evict, preempts itself. Readmission
    # follows arrival (r1 before r2), not the order of preemption.
    h = Harness(num_blocks=3, block_size=2, limits=SchedulerLimits(8, 64, 64), eos=None)
    for i in range(3):
        h.add(f"r{i}", spec(2, 3, first=i))
    s0, s1, s2 = (h.seq_of[f"r{i}"] for i in range(3))
    h.step()
    assert list(h.policy.plans[-1].run) == [s0, s1, s2]
    h.step()
    assert list(h.policy.plans[-1].preempt) == [s2, s1] and list(h.policy.plans[-1].run) == [s0]
    while h.engine.has_unfinished:
        h.step()
    h.check_done()
    readmitted = [s for p in h.policy.plans[2:] for s in p.run if s in (s1, s2) and p.run[s] > 1]
    assert readmitted[:2] == [s1, s2]
    assert h.final["r1"].metrics.num_preemptions == h.final["r2"].metrics.num_preemptions == 1
    assert h.final["r0"].metrics.num_preemptions == 0


# --------------------------------------------------------------------------- pure policy
@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_schedule_is_pure_and_state_accepts_plan(data: st.DataObject) -> None:
    """Drive to a random point, then: schedule twice on one view -> same plan, view untouched,
    and the state applies the plan without error."""
    cfg = data.draw(configs(), label="config")
    specs = data.draw(specs_for(cfg), label="requests")
    h = Harness(**cfg)
    for i, spec in enumerate(specs):
        h.add(f"r{i}", spec)
    for _ in range(data.draw(st.integers(0, 30), label="steps")):
        if not h.engine.has_unfinished:
            break
        h.step()
    view = h.state.snapshot(h.clock())
    before = copy_arrays(view.requests)
    scalars = view_scalars(view)
    policy = VLLMPolicy()
    plan = policy.schedule(view)
    assert_view_unchanged(view, before, scalars)
    again = policy.schedule(view)
    assert (dict(again.run), dict(again.allocate), again.preempt) == (
        dict(plan.run), dict(plan.allocate), plan.preempt
    )
    assert list(again.run) == list(plan.run)
    check_vllm_plan(view, plan)
    assert plan.num_batched_tokens > 0 or plan.preempt or len(view.requests) == 0
    h.state.apply(plan, view.now)  # raises PlanError if the state cannot honour it
    h.state.check_invariants()
    batch = h.state.batch()
    if batch.num_seqs:
        h.state.commit(batch, h.runner.execute(batch), h.clock())
    else:
        h.state.commit(batch, StepOutput.empty(), h.clock())
    h.check()
    while h.engine.has_unfinished:  # and the rest still drains
        h.step()


def test_plan_mappings_are_read_only() -> None:
    plan = Plan(run={1: 1})
    with pytest.raises(TypeError):
        plan.run[2] = 1  # type: ignore[index]


def test_config_where_decodes_could_exceed_the_token_budget_is_refused() -> None:
    # Admission spreads prompts over steps, so max_num_seqs running requests would later
    # need max_num_seqs decode tokens in one step.
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 < max_num_seqs=8"):
        EngineState(num_blocks=64, block_size=4, limits=limits, eos_token_id=None, vocab_size=16)


def test_refused_plan_changes_nothing() -> None:
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16)
    engine = assemble_engine(VLLMPolicy(), FakeRunner(4, 4, limits, 16), FakeClock(), num_blocks=4,
                             block_size=4, limits=limits, vocab_size=16)
    state = engine.state
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    before = state.snapshot(0.0)
    [a, b] = before.requests.seq_id.tolist()
    # Preempting `a` frees its block, then over-allocates to `b`: refused as a whole.
    bad = Plan(run={b: 1}, allocate={b: 5}, preempt=[a])
    with pytest.raises(PlanError, match="plan takes 5 blocks, 3 free"):
        state.apply(bad, 0.0)
    after = state.snapshot(0.0)
    for name in ("status", "num_blocks", "num_computed", "num_preemptions"):
        np.testing.assert_array_equal(getattr(before.requests, name), getattr(after.requests, name))
    assert after.num_free_blocks == before.num_free_blocks
    state.check_invariants()
