"""Every registered policy on random traces, through the real EngineState/Engine loop and the
fake paged-KV runner of `policy_harness`.

For each policy in `jserve.policies.POLICIES` (with its defaults and, when it has a
`token_budget`, also with a small one so prompts are chunked often): random traces with a
tight cache (block size 1..16), arrivals between steps, eos, invalid prompts and aborts;
the engine's invariants and the generic bookkeeping after every step; every request ends
with exactly the output it would have produced alone (an aborted one with a prefix of it); the cache ends all free; a bound on
the number of steps catches livelock. Policies with a token budget also get the chunked
checks (`check_chunked_plan`). vLLM's own rules are checked in `test_vllm_policy_properties`.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from property_examples import examples
from policy_harness import (
    Harness,
    PlanCheck,
    aborts_strategy,
    assert_view_unchanged,
    check_plan,
    configs,
    copy_arrays,
    plan_key,
    spec,
    specs_for,
    view_scalars,
)

from jserve.cache_features.swap_tier.section import swaps
from jserve.engine.batch import StepOutput
from jserve.engine.plan import Plan
from jserve.engine.policy import Policy
from jserve.engine.request import RequestStatus
from jserve.engine.view import SchedulerLimits, SchedulerView
from jserve.policies import POLICIES
from jserve.policies.apt_serve import AptServePolicy
from jserve.policies.cacheopt import CacheOptPolicy
from jserve.policies.rlp import RLPPolicy
from jserve.policies.s3 import S3Policy

SMALL_TOKEN_BUDGET = 8  # >= the largest max_num_seqs `configs` draws, so decodes always fit


def _has_field(policy: Policy, name: str) -> bool:
    return dataclasses.is_dataclass(policy) and any(f.name == name for f in dataclasses.fields(policy))


# Prediction-based policies' margins scaled to the harness's short requests (max_model_len
# <= 48), so that under-provisioned reservations, extensions and preemptions happen: with
# the defaults (RLP's +100 tokens, S3's 50-token buckets, CacheOpt's +-100-token error
# range) nearly every reservation is the whole max_len.
SMALL_MARGINS = {"margin_tokens": 2, "bucket_tokens": 4, "error_range": (-3.0, 3.0)}


def _variants() -> list[tuple[str, Policy]]:
    out = []
    for name, factory in POLICIES.items():
        policy = factory()
        out.append((name, policy))
        if _has_field(policy, "token_budget"):
            out.append((f"{name}-budget{SMALL_TOKEN_BUDGET}", dataclasses.replace(policy, token_budget=SMALL_TOKEN_BUDGET)))
        small = {k: v for k, v in SMALL_MARGINS.items() if _has_field(policy, k)}
        if small and "/" not in name:
            out.append((f"{name}-small", dataclasses.replace(policy, **small)))
        if "/" in name:  # an ablation: also with small margins, so its component matters
            out[-1] = (name, dataclasses.replace(policy, **small))
    return out


VARIANTS = _variants()
# Known failures, by variant id: mark them xfail(strict=True) with the reproduction in the
# reason, never weaken a check for them.
KNOWN_BUGS: dict[str, str] = {}


def _cases(ablations: bool = False) -> list:
    """Every variant; CacheOpt's ablations (ids with '/') apart, so that they run fewer
    examples (`ABLATION_PROPERTY`) and the file stays fast."""
    return [
        pytest.param(policy, id=vid, marks=[pytest.mark.xfail(reason=KNOWN_BUGS[vid], strict=True)] if vid in KNOWN_BUGS else [])
        for vid, policy in VARIANTS if ("/" in vid) == ablations
    ]


# --------------------------------------------------------------------------- chunked checks
def check_chunked_plan(view: SchedulerView, plan: Plan, token_budget: int) -> None:
    """Decode-first chunked prefill under a token budget (Sarathi-Serve, FastGen)."""
    r = view.requests
    row = {int(s): i for i, s in enumerate(r.seq_id)}
    budget = min(token_budget, view.limits.max_num_batched_tokens)
    assert plan.num_batched_tokens <= budget, f"plan runs {plan.num_batched_tokens} tokens, budget {budget}"
    for s, n in plan.run.items():
        assert n <= r.num_tokens[row[s]] - r.num_computed[row[s]], f"seq {s}: chunk past the prompt"
    decodes = [
        int(r.seq_id[i]) for i in r.with_status(RequestStatus.RUNNING) if r.num_tokens[i] - r.num_computed[i] == 1
    ]
    is_decode = [s in set(decodes) for s in plan.run]
    # Decodes first in the batch: no decode after a prompt chunk.
    assert is_decode == sorted(is_decode, reverse=True), f"a prompt chunk precedes a decode: {list(plan.run.items())}"
    left_out = [s for s in decodes if s not in plan.run and s not in plan.preempt]
    if left_out:
        # Only when decodes alone filled the budget.
        assert all(is_decode) and plan.num_batched_tokens == budget, f"decodes {left_out} left out"


def check_reservations(view: SchedulerView, plan: Plan) -> None:
    """Reserving policies (RLP, S3, CacheOpt): after the plan every request holds at most
    its reservation (so no reservation is cut below what its request holds), reservations
    are set only for requests that keep or gain device blocks, and they sum to at most the
    cache."""
    r = view.requests
    reserved = {int(s): int(n) for s, n in zip(r.seq_id, r.reserved_blocks)}
    reserved.update(plan.reserve)
    for s in plan.preempt:
        assert s not in plan.reserve, f"seq {s}: reserved for and preempted"
        reserved[s] = 0
    for i, s in enumerate(r.seq_id.tolist()):
        held = plan.allocate.get(s, 0)
        if s not in plan.preempt:
            held += int(r.num_blocks[i]) + (int(r.num_host_blocks[i]) if s in swaps(plan).back else 0)
        assert held <= reserved[s], f"seq {s}: holds {held} blocks after the plan, reserved {reserved[s]}"
    assert sum(reserved.values()) <= view.num_blocks, f"reserves {sum(reserved.values())} blocks"


def plan_checks_for(policy: Policy) -> tuple[PlanCheck, ...]:
    checks: tuple[PlanCheck, ...] = (check_holders_within_max_num_seqs,)
    if policy.capabilities.reserves:
        checks += (check_reservations,)
    if policy.chunked_prefill and _has_field(policy, "token_budget"):
        budget = policy.token_budget  # type: ignore[attr-defined]
        checks += (lambda view, plan: check_chunked_plan(view, plan, budget),)
        if not (isinstance(policy, AptServePolicy) and policy.adaptive):  # Apt-Serve-S picks victims by value
            checks += (check_victims_arrived_later,)
    return checks


def harness(policy: Policy, cfg: dict) -> Harness:
    return Harness(**cfg, policy=policy, plan_checks=plan_checks_for(policy))


def policy_configs(policy: Policy) -> st.SearchStrategy[dict]:
    return configs(chunked=policy.chunked_prefill, block_sizes=st.integers(1, 16), hidden=True)


# --------------------------------------------------------------------------- random traces
PROPERTY = settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("policy", _cases())
@PROPERTY
@given(data=st.data())
def test_random_traces_keep_invariants_and_outputs(policy: Policy, data: st.DataObject) -> None:
    """Random traces with aborts (none in some): an aborted request frees its blocks at once
    and ends with a prefix of its output, every other one with its whole output.

    One test for both, as the ablations have: an abort-free test ran the same checks on the
    same draws, and most of these traces abort nothing anyway (`aborted: 0`, 43-90% of them
    in a CI run of the vllm, sarathi and cacheopt variants), so it only doubled each
    policy's traces."""
    cfg = data.draw(policy_configs(policy), label="config")
    specs = data.draw(specs_for(cfg), label="requests")
    aborts = data.draw(aborts_strategy(), label="aborts")
    h = harness(policy, cfg)
    h.run(specs, aborts)
    event(f"aborted: {len(h.aborted)}")
    event(f"preempted: {h.engine.stats.num_preemptions > 0}")
    event(f"swapped: {h.engine.stats.num_swaps > 0}")
    event(f"prompt chunked: {h.policy.num_partial_chunks > 0}")


ABLATION_PROPERTY = settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("policy", _cases(ablations=True))
@ABLATION_PROPERTY
@given(data=st.data())
def test_ablations_keep_invariants_and_outputs(policy: Policy, data: st.DataObject) -> None:
    """CacheOpt with one component off: the same traces and checks as above."""
    cfg = data.draw(policy_configs(policy), label="config")
    specs = data.draw(specs_for(cfg), label="requests")
    h = harness(policy, cfg)
    h.run(specs, data.draw(aborts_strategy(), label="aborts"))
    event(f"preempted: {h.engine.stats.num_preemptions > 0}")
    event(f"swapped: {h.engine.stats.num_swaps > 0}")


@pytest.mark.parametrize("policy", _cases())
@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_schedule_is_pure_and_state_accepts_plan(policy: Policy, data: st.DataObject) -> None:
    """At a random point of a trace: scheduling twice on one view (and on a fresh copy of the
    policy) gives the same plan, leaves the view and the policy untouched, and the state
    applies that plan; the rest of the trace still drains."""
    cfg = data.draw(policy_configs(policy), label="config")
    specs = data.draw(specs_for(cfg), label="requests")
    h = harness(policy, cfg)
    for i, spec in enumerate(specs):
        if spec.arrive_step == 0:
            h.add(f"r{i}", spec)
    for k in range(data.draw(st.integers(0, 30), label="steps")):
        for i, spec in enumerate(specs):
            if spec.arrive_step == k + 1:
                h.add(f"r{i}", spec)
        if not h.engine.has_unfinished:
            break
        h.step()
    view = h.state.snapshot(h.clock())
    before, scalars = copy_arrays(view.requests), view_scalars(view)
    config = copy.deepcopy(vars(policy))
    plan = policy.schedule(view)
    assert_view_unchanged(view, before, scalars)
    assert vars(policy) == config, "schedule changed the policy"
    assert plan_key(policy.schedule(view)) == plan_key(plan)
    assert plan_key(copy.deepcopy(policy).schedule(view)) == plan_key(plan)
    check_plan(view, plan)
    for check in plan_checks_for(policy):
        check(view, plan)
    assert plan.num_batched_tokens > 0 or plan.preempt or plan.features or len(view.requests) == 0, \
        "the engine would stall"
    h.state.apply(plan, view.now)  # raises PlanError if the state cannot honour it
    h.state.check_invariants()
    batch = h.state.batch()
    if batch.moves_blocks and not batch.num_seqs:  # as Engine.step: a lone swap-out still runs
        h.runner.execute(batch)
    out = h.runner.execute(batch) if batch.num_seqs else StepOutput.empty()
    h.state.commit(batch, out, h.clock())
    h.check()
    while h.engine.has_unfinished:  # and the rest still drains
        h.step()


def test_registry_is_covered() -> None:
    assert {vid.split("-budget")[0].removesuffix("-small") for vid, _ in VARIANTS} == set(POLICIES)
    for name, policy in VARIANTS:
        assert isinstance(policy.name, str) and isinstance(policy.chunked_prefill, bool), name


def check_holders_within_max_num_seqs(view: SchedulerView, plan: Plan) -> None:
    """Requests holding KV after the plan (running, not preempted, plus admissions) never
    exceed max_num_seqs, even when some of them sit out the step."""
    r = view.requests
    row = {int(s): i for i, s in enumerate(r.seq_id)}
    running = {int(s) for s in r.seq_id[r.status == RequestStatus.RUNNING]}
    admitted = {s for s in plan.run if r.status[row[s]] == RequestStatus.WAITING}
    holders = (running - set(plan.preempt)) | admitted
    assert len(holders) <= view.limits.max_num_seqs, f"{len(holders)} requests hold KV"


# --------------------------------------------------------------------------- known deviations
def check_victims_arrived_later(view: SchedulerView, plan: Plan) -> None:
    """The chunked policies' own rule ("the latest-arrived running request is preempted"),
    as vLLM applies it: a running request that needs a block preempts only requests that
    arrived after it, else itself, so no request that keeps running arrived after a victim.
    (Admitting a *new* request in a step that preempts is allowed, as in vLLM v0's
    chunked-prefill scheduler.)"""
    r = view.requests
    row = {int(s): i for i, s in enumerate(r.seq_id)}
    ran = [s for s in plan.run if r.status[row[s]] == RequestStatus.RUNNING]
    if plan.preempt and ran:
        last = max(r.arrival_time[row[s]] for s in ran)
        early = [s for s in plan.preempt if r.arrival_time[row[s]] < last]
        assert not early, f"preempted {early}, which arrived before a running request that runs: {dict(plan.run)}"


# Minimal traces (shrunk by hypothesis) in which a decoding request that needs a block once
# preempted an *earlier* arrival that was mid-prompt and not yet in the batch, instead of
# preempting itself (a priority inversion; outputs stayed correct):
# - fastgen, step 8: seq 2 (arrived 3rd, decoding) preempted seq 1 (arrived 2nd, prompt 3/5 done);
# - sarathi, step 26: seq 3 (arrived 4th, decoding) preempted seq 2 (arrived 3rd, prompt 7/36).
VICTIM_ORDER_TRACES = [
    pytest.param(
        "fastgen", dict(num_blocks=7, block_size=1, limits=SchedulerLimits(2, 2, 6)),
        [spec(2, 4, arrive=1), spec(1, 5), spec(5, 1)], id="fastgen",
    ),
    pytest.param(
        "sarathi", dict(num_blocks=11, block_size=4, limits=SchedulerLimits(2, 2, 37)),
        [spec(36, 1, arrive=1), spec(24, 1), spec(4, 6), spec(1, 9, arrive=1)], id="sarathi",
    ),
]


@pytest.mark.parametrize("name, cfg, specs", VICTIM_ORDER_TRACES)
def test_chunked_victims_arrived_after_every_running_request(name: str, cfg: dict, specs: list) -> None:
    policy = POLICIES[name]()
    h = Harness(**cfg, eos=None, vocab_size=8, policy=policy, plan_checks=plan_checks_for(policy))
    h.run(specs)


def test_fastgen_admits_no_request_past_max_num_seqs_holders() -> None:
    """Shrunk trace in which fastgen once had three requests holding KV with max_num_seqs=2:
    a prompt waiting for blocks keeps the ones it has, and admission counted only the step's
    batch."""
    policy = POLICIES["fastgen"]()
    h = Harness(num_blocks=8, block_size=6, limits=SchedulerLimits(2, 9, 38), eos=None,
                vocab_size=8, policy=policy, plan_checks=plan_checks_for(policy))
    h.run([spec(18, 8), spec(28, 1), spec(23, 4)] + [spec(1, 1, arrive=1)] * 4)


@pytest.mark.parametrize("num_host_blocks", [1, 64])
def test_vllm_swap_swaps_and_keeps_outputs(num_host_blocks: int) -> None:
    """Four long requests over a cache of three requests' worth: the latest arrivals are
    swapped out and back (with a 1-block host tier, too small for them, they are recomputed
    instead); either way every output equals the unpreempted run (`check_done`)."""
    policy = POLICIES["vllm-swap"]()
    h = Harness(num_blocks=12, block_size=4, limits=SchedulerLimits(4, 48, 48), eos=None,
                vocab_size=16, policy=policy, num_host_blocks=num_host_blocks)
    h.run([spec(10, 30, arrive=0)] * 4)
    preempted = sum(len(p.preempt) for p in h.policy.plans)
    assert preempted > 0
    if num_host_blocks > 1:
        assert h.runner.num_swaps == preempted
        assert sum(len(swaps(p).back) for p in h.policy.plans) == preempted
    else:
        assert h.runner.num_swaps == 0


def _under_predicted(n: int, plen: int, max_tokens: int, predicted: int) -> list:
    """`n` requests whose outputs run far past an (under-)prediction. EOS is not ignored
    (the harness has none, so they still run to `max_tokens`): with it ignored the length
    would be known and replace the prediction (`jserve.engine.admission.known_prediction`)."""
    return [dataclasses.replace(spec(plen, max_tokens, first=k), predicted_len=predicted, predicted_dir=-1,
                                ignore_eos=False)
            for k in range(n)]


RESERVING_TRACES = [
    pytest.param(RLPPolicy(margin_tokens=2), 0, id="rlp"),
    pytest.param(S3Policy(bucket_tokens=4), 0, id="s3"),
    pytest.param(CacheOptPolicy(true_to_predicted=(0.5, 2.0)), 0, id="cacheopt"),
    pytest.param(CacheOptPolicy(true_to_predicted=(0.5, 2.0)), 64, id="cacheopt-host"),
]


@pytest.mark.parametrize("policy, num_host_blocks", RESERVING_TRACES)
def test_reserving_policies_preempt_under_prediction_and_keep_outputs(policy: Policy,
                                                                      num_host_blocks: int) -> None:
    """Four requests predicted at 4 output tokens that run to 30, over a cache of three
    requests' worth: reservations run out, get extended and (RLP, CacheOpt) evict others or
    (S3) their own request, which comes back with a doubled demand; with a host tier CacheOpt
    swaps its victims out and back. Every output equals the unpreempted run (`check_done`)
    and every plan keeps held <= reserved (`check_reservations`)."""
    h = Harness(num_blocks=12, block_size=4, limits=SchedulerLimits(4, 48, 48), eos=None,
                vocab_size=16, policy=policy, plan_checks=plan_checks_for(policy),
                num_host_blocks=num_host_blocks)
    h.run(_under_predicted(4, 10, 30, predicted=4))
    preempted = sum(len(p.preempt) for p in h.policy.plans)
    print(f"{policy.name}: {preempted} preemptions, {h.runner.num_swaps} swaps")
    assert preempted > 0
    assert any(p.reserve for p in h.policy.plans)
    if num_host_blocks:
        assert h.runner.num_swaps > 0
        assert sum(len(swaps(p).back) for p in h.policy.plans) == h.runner.num_swaps
    else:
        assert h.runner.num_swaps == 0


def test_cacheopt_embeds_into_a_running_requests_padding() -> None:
    """A long-padded request (4-token prompt, 10 predicted, padded by ~86 tokens) holds most
    of the cache; later short requests do not fit the pool and are embedded into its unused
    allocation (its reservation shrinks while it runs); outputs stay the unpreempted run's."""
    policy = CacheOptPolicy(true_to_predicted=(0.1, 10.0))
    h = Harness(num_blocks=30, block_size=4, limits=SchedulerLimits(4, 128, 128), eos=None,
                vocab_size=16, policy=policy, plan_checks=plan_checks_for(policy))
    short = [dataclasses.replace(spec(4, 6, arrive=k, first=k), predicted_len=4) for k in (1, 2, 3)]
    h.run([dataclasses.replace(spec(4, 100), predicted_len=10, predicted_dir=-1)] + short)
    first = h.seq_of["r0"]
    shrunk = [p.reserve[first] for p in h.policy.plans if first in p.reserve]
    assert len(shrunk) >= 2 and shrunk[1] < shrunk[0], shrunk
