"""The prefix cache in the engine: reuse of cached blocks, sharing by reference count,
eviction through the plan, and random traces whose prompts share prefixes.

The eviction rules themselves (which blocks go) are tested on hand-made snapshots in
`test_eviction_rules`; here the question is whether the engine's bookkeeping holds and
outputs stay exactly those of an engine without a cache.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from property_examples import examples
from policy_harness import FakeClock, FakeRunner, Harness, Spec, configs

from jserve.builder import assemble_engine
from jserve.cache.prefix import PrefixCacheConfig
from jserve.engine.loop import Engine
from jserve.engine.plan import Plan
from jserve.engine.request import RequestStatus
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.view import SchedulerLimits
from jserve.errors import PlanError
from jserve.policies import POLICIES, make_policy
from jserve.policies.tail_optimized_lru import EVICTION_RULES
from jserve.policies.vllm import VLLMPolicy

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def _engine(num_blocks: int = 16, block_size: int = 4, capacity: int | None = None,
            isolation: bool = False) -> Engine:
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    runner = FakeRunner(num_blocks, block_size, limits, 100,
                        context_of=lambda seq: engine.state.requests[seq].all_token_ids)
    engine = assemble_engine(VLLMPolicy(), runner, FakeClock(), num_blocks=num_blocks,
                             block_size=block_size, limits=limits, vocab_size=100,
                             prefix_cache=PrefixCacheConfig("lru", capacity, isolation))
    return engine


def _drain(engine: Engine) -> None:
    while engine.has_unfinished:
        engine.step()
        engine.state.check_invariants()


def test_a_later_prompt_reuses_the_full_blocks_of_a_finished_one() -> None:
    engine = _engine()
    state = engine.state
    engine.add_request("a", list(range(1, 11)), GREEDY)  # 10 tokens: blocks [1-4] [5-8] + 2
    _drain(engine)
    # "a" computed 11 tokens (10 + its first output): two full blocks stay cached.
    assert state.blocks.num_evictable == 2
    engine.add_request("b", list(range(1, 9)) + [50, 51, 52], GREEDY)
    view = state.snapshot(0.0)
    assert view.requests.num_computed.tolist() == [8]  # both blocks hit
    _drain(engine)
    assert state.blocks.num_evictable >= 2


def test_a_prompt_wholly_cached_still_computes_its_last_token() -> None:
    engine = _engine()
    engine.add_request("a", list(range(1, 9)), GREEDY)
    _drain(engine)
    engine.add_request("b", list(range(1, 9)), GREEDY)  # 8 tokens = the two cached blocks
    assert engine.state.snapshot(0.0).requests.num_computed.tolist() == [4]


def test_isolation_keeps_conversations_apart() -> None:
    engine = _engine(isolation=True)
    engine.add_request("a", list(range(1, 11)), GREEDY, conversation_id="x")
    _drain(engine)
    engine.add_request("b", list(range(1, 11)), GREEDY, conversation_id="y")
    assert engine.state.snapshot(0.0).requests.num_computed.tolist() == [0]
    engine.add_request("c", list(range(1, 11)), GREEDY, conversation_id="x")
    assert sorted(engine.state.snapshot(0.0).requests.num_computed.tolist()) == [0, 8]


def test_running_requests_share_cached_blocks_and_keep_them_from_eviction() -> None:
    engine = _engine(num_blocks=8)
    state = engine.state
    engine.add_request("a", list(range(1, 9)) + [9], GREEDY)
    _drain(engine)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("b", list(range(1, 9)) + [20], params)
    engine.add_request("c", list(range(1, 9)) + [30], params)
    engine.step()  # both admitted on the two cached blocks
    shared = [b for b in state.blocks.table(1)[:2]]
    assert state.blocks.table(2)[:2] == shared
    assert state.blocks.ref_counts[shared].tolist() == [2, 2]
    with pytest.raises(PlanError, match="still uses"):
        state.apply(Plan(evict=frozenset(shared)), 0.0)
    _drain(engine)


def test_eviction_frees_what_an_allocation_needs_and_capacity_bounds_the_cache() -> None:
    engine = _engine(num_blocks=6, capacity=8)  # at most two unreferenced blocks cached
    state = engine.state
    for i, first in enumerate((1, 30, 60)):
        engine.add_request(f"r{i}", list(range(first, first + 10)), GREEDY)
        _drain(engine)
        assert state.blocks.num_evictable <= 2  # trimmed by the step that released them
    engine.add_request("big", list(range(70, 90)), GREEDY)  # 20 tokens: 6 blocks, all of them
    _drain(engine)
    assert engine.stats.num_evicted_blocks > 0


def test_an_abort_trims_the_history_it_releases_to_the_capacity() -> None:
    engine = _engine(num_blocks=8, capacity=8)  # at most two unreferenced blocks cached
    engine.add_request("a", list(range(1, 21)), SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()  # its 20-token prompt computed: five full blocks
    engine.abort("a")
    assert engine.stats.num_evicted_blocks == 3
    assert engine.state.blocks.num_evictable == 2
    engine.state.check_invariants()


def test_a_plan_may_not_evict_blocks_a_request_it_starts_takes_over() -> None:
    engine = _engine()
    state = engine.state
    engine.add_request("a", list(range(1, 10)), GREEDY)
    _drain(engine)
    engine.add_request("b", list(range(1, 10)), GREEDY)
    view = state.snapshot(0.0)
    plan = engine.policy.schedule(view)
    hit = state.blocks.evictable().tolist()
    with pytest.raises(PlanError, match="takes from the cache"):
        state.apply(dataclasses.replace(plan, evict=frozenset(hit)), 0.0)


def test_evicting_a_chain_head_orphans_the_rest() -> None:
    engine = _engine()
    state = engine.state
    engine.add_request("a", list(range(1, 14)), GREEDY)  # three full blocks cached
    _drain(engine)
    head = int(state.blocks.evictable()[np.argmin(state.prefix.depth[state.blocks.evictable()])])
    state.apply(Plan(evict=frozenset([head])), 0.0)
    state.check_invariants()
    engine.add_request("b", list(range(1, 14)), GREEDY)
    assert state.snapshot(0.0).requests.num_computed.tolist() == [0]  # nothing reachable


def test_evicted_blocks_are_demoted_to_the_host_tier_and_promoted_on_reuse() -> None:
    engine = _engine(capacity=0)  # every unreferenced block is evicted when released
    state = engine.state
    state.prefix.host_capacity_blocks = 3  # room for "a"'s two blocks and "x"'s one
    engine.add_request("a", list(range(1, 11)), GREEDY)  # two full blocks
    _drain(engine)
    assert state.prefix.num_host_entries == 2  # demoted by the trim after a's last step
    engine.add_request("x", list(range(50, 55)), GREEDY)  # its step copies them to the host
    _drain(engine)
    assert state.prefix.num_host_entries == 3 and "a" not in engine.runner.host
    engine.add_request("b", list(range(1, 11)), GREEDY)
    assert state.snapshot(0.0).requests.num_computed.tolist() == [8]  # both, from the host
    _drain(engine)
    assert engine.runner.num_promotions == 2  # copied back; the fake runner checked the KV
    # The host tier keeps the most recently demoted blocks when it overflows.
    assert state.prefix.num_host_entries <= 3


def test_one_host_copy_goes_to_the_earliest_of_two_waiting_requests() -> None:
    engine = _engine(capacity=0)
    state = engine.state
    state.prefix.host_capacity_blocks = 4
    engine.add_request("a", list(range(1, 6)), GREEDY)
    _drain(engine)
    engine.add_request("x", list(range(50, 55)), GREEDY)
    _drain(engine)
    engine.add_request("b", list(range(1, 6)), GREEDY, arrival_time=1.0)
    engine.add_request("c", list(range(1, 6)), GREEDY, arrival_time=2.0)
    assert sorted(state.snapshot(0.0).requests.num_computed.tolist()) == [0, 4]
    _drain(engine)


def test_the_index_forgets_conversations_whose_blocks_are_all_evicted() -> None:
    """A long-running server sees unboundedly many conversations; the index keeps only
    those that still own cached blocks."""
    engine = _engine(capacity=8)
    for i in range(30):
        engine.add_request(f"r{i}", list(range(3 * i + 1, 3 * i + 11)), GREEDY)
        _drain(engine)
    state = engine.state
    cached = int(state.prefix.cached.sum())
    assert 0 < state.prefix.num_conversations <= cached <= 2 + 2


# --------------------------------------------------------------------------- random traces
@st.composite
def shared_prefix_specs(draw: st.DrawFn, cfg: dict, max_requests: int = 10) -> list[Spec]:
    """Prompts that often start with (part of) an earlier prompt, as chat turns and shared
    system prompts do, arriving over the first steps."""
    lim: SchedulerLimits = cfg["limits"]
    limit = min(lim.max_model_len, cfg["num_blocks"] * cfg["block_size"]) - 1
    vocab = cfg["vocab_size"]
    prompts: list[list[int]] = []
    out = []
    for _ in range(draw(st.integers(1, max_requests))):
        head: list[int] = []
        if prompts and draw(st.integers(0, 3)):
            base = draw(st.sampled_from(prompts))
            head = base[: draw(st.integers(len(base) // 2, len(base)))]
        tail = draw(st.lists(st.integers(0, vocab - 1), min_size=0 if head else 1,
                             max_size=max(1, limit - len(head))))
        prompt = (head + tail)[: max(1, limit)]
        prompts.append(prompt)
        out.append(Spec(prompt=prompt, max_tokens=draw(st.integers(1, 20)),
                        ignore_eos=draw(st.booleans()), arrive_step=draw(st.integers(0, 40))))
    return out


def _policies() -> list[str]:
    """Every policy a prefix cache may run with: not those that offload layers (LayerKV),
    which `EngineConfig` refuses with one."""
    return sorted(name for name, make in POLICIES.items() if not make().capabilities.offloads_layers)


@pytest.mark.parametrize("policy", _policies())
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_shared_prefix_traces_keep_invariants_and_outputs(policy: str, data: st.DataObject) -> None:
    """Every policy with a prefix cache (any eviction rule, capacity and isolation): the
    harness checks after every step that no block leaks or is freed twice, that a shared
    block is cached and referenced once per holder (so never evicted while held), that
    nothing writes into a shared block, that every KV read holds the reader's own tokens,
    and at the end that each output equals the request's output alone."""
    pol = make_policy(policy)
    cfg = data.draw(configs(chunked=pol.chunked_prefill, block_sizes=st.integers(1, 8)), label="config")
    specs = data.draw(shared_prefix_specs(cfg), label="requests")
    cache = PrefixCacheConfig(
        eviction=data.draw(st.sampled_from(sorted(EVICTION_RULES)), label="eviction"),
        capacity_tokens=data.draw(st.sampled_from([None, 0, 4, 16, 64]), label="capacity"),
        isolation=data.draw(st.booleans(), label="isolation"),
        host_capacity_tokens=data.draw(st.sampled_from([0, 8, 64]), label="host tier"),
    )
    h = Harness(**cfg, policy=pol, prefix_cache=cache)
    h.run(specs)
    hits = sum(out.metrics.num_cached_tokens > 0 for out in h.final.values())
    event(f"hits: {hits > 0}")
    event(f"evicted: {h.engine.stats.num_evicted_blocks > 0}")
    event(f"promoted from host: {h.runner.num_promotions > 0}")
    event(f"preempted: {h.engine.stats.num_preemptions > 0}")


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "vllm-swap"])
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_traces_through_a_host_tier(policy: str, data: st.DataObject) -> None:
    """A device cache that keeps nothing unreferenced and a host tier: every finished
    block is demoted, and a later prompt's hit is copied back (the fake runner poisons
    freed blocks, so a promotion that loaded the wrong copy changes the outputs)."""
    pol = make_policy(policy)
    cfg = data.draw(configs(chunked=pol.chunked_prefill, block_sizes=st.integers(1, 4)), label="config")
    specs = data.draw(shared_prefix_specs(cfg), label="requests")
    cache = PrefixCacheConfig(eviction=data.draw(st.sampled_from(["lru", "tlru"]), label="eviction"),
                              capacity_tokens=0, host_capacity_tokens=data.draw(st.sampled_from([4, 64])))
    h = Harness(**cfg, policy=pol, prefix_cache=cache)
    h.run(specs)
    event(f"promoted from host: {h.runner.num_promotions > 0}")


def test_waiting_request_with_a_cached_prefix_is_shown_as_partly_computed() -> None:
    engine = _engine()
    engine.add_request("a", list(range(1, 10)), GREEDY)
    _drain(engine)
    engine.add_request("b", list(range(1, 10)), GREEDY)
    r = engine.state.snapshot(0.0).requests
    assert r.status.tolist() == [RequestStatus.WAITING] and r.num_computed.tolist() == [8]
    assert r.num_blocks.tolist() == [0]


# --------------------------------------------------------------------------- real model
def _conversations(vocab: int) -> tuple[list, object]:
    """Three chats of three turns, all arriving at once, each turn right after its reply:
    every turn after the first starts with its whole history."""
    from jserve.benchmarking.conversations import (
        ConversationArrivals,
        schedule_conversations,
        synthetic_message_ids,
    )
    from jserve.benchmarking.workload import ConversationTrace, ConversationTurn

    chats = [ConversationTrace(f"c{i}", tuple(ConversationTurn(p, r, "", "") for p, r in turns))
             for i, turns in enumerate([[(9, 6), (5, 7), (6, 4)], [(13, 5), (7, 6), (3, 5)],
                                        [(6, 8), (9, 4), (5, 6)]])]
    arrivals = ConversationArrivals("think-time", conversation_rate=float("inf"), think_time=0.0)
    schedule = schedule_conversations(chats, arrivals, seed=0)
    return schedule, lambda cid, k, turn: synthetic_message_ids(cid, k, turn.new_tokens, vocab)


def _chat_outputs(llm, schedule, message_ids) -> tuple[dict[str, list[int]], int]:
    """Each turn's output ids, and how many prompt tokens came from the prefix cache."""
    from jserve.benchmarking.conversations import run_conversations
    from jserve.engine.clock import WallClock

    outputs: dict[str, list[int]] = {}
    cached_tokens = 0
    step = llm.engine.step

    def recording_step():
        nonlocal cached_tokens
        for r in (done := step()):
            if r.finished:
                outputs[r.request_id] = list(r.output_token_ids)
                cached_tokens += r.metrics.num_cached_tokens
        return done

    llm.engine.step = recording_step
    run_conversations(llm.engine, schedule, WallClock(), message_ids)
    return outputs, cached_tokens


@pytest.mark.parametrize(("eviction", "host"), [(rule, 0) for rule in sorted(EVICTION_RULES)]
                         + [("lru", 64), ("tlru", 64)])
def test_greedy_outputs_identical_with_the_prefix_cache_on_and_off(tiny_loaded, eviction: str,
                                                                   host: int) -> None:
    """Multi-turn chats on the tiny model: with a cache of a few blocks every rule must
    evict, and each turn reuses what its rule kept (with `host`, evicted blocks go to host
    memory through the runner's swap path and come back on reuse); the greedy ids equal
    those of an engine without a prefix cache."""
    from jserve import LLM
    from jserve.benchmarking.conversations import conversation_futures

    schedule, message_ids = _conversations(tiny_loaded.config.vocab_size)
    plain = LLM(tiny_loaded, num_blocks=64, block_size=4, max_model_len=64, warmup=False)
    expected, _ = _chat_outputs(plain, schedule, message_ids)
    # The oracles read the schedule's future, which only a benchmark knows. Threshold-LRU's
    # 1,024 tokens and Q_hat's 100 scale down to these chats of at most 64 tokens.
    cache = PrefixCacheConfig(eviction, capacity_tokens=24, tel_threshold=0.05, q_hat=4.0,
                              history_threshold=16, host_capacity_tokens=host,
                              futures=conversation_futures(schedule))
    cached = LLM(tiny_loaded, num_blocks=24, block_size=4, max_model_len=64, warmup=False,
                 prefix_cache=cache)
    outputs, cached_tokens = _chat_outputs(cached, schedule, message_ids)
    assert outputs == expected
    stats, state = cached.engine.stats, cached.engine.state
    print(f"{eviction}: {cached_tokens} prompt tokens from the cache, "
          f"{stats.num_evicted_blocks} blocks evicted")
    assert cached_tokens > 0 and stats.num_evicted_blocks > 0
    if host:
        assert state.prefix.num_host_entries > 0
    state.check_invariants()
    assert state.blocks.num_free + state.blocks.num_evictable == 24


def _served_from_cache(eviction: str, capacity: int | None, counts: str) -> tuple[list[int], float]:
    """Multi-turn chats in the simulator whose next turn arrives the moment its reply
    ends (think time 0, the case where a released history used to be taken over whole
    before the capacity was enforced): each turn's cached prompt tokens, and the share
    of all prompt tokens the cache served."""
    from jserve.benchmarking.conversations import (
        ScheduledConversation,
        ScheduledTurn,
        conversation_futures,
        run_conversations,
        synthetic_message_ids,
    )
    from jserve.builder import build_engine
    from jserve.config import EngineConfig

    rng = np.random.default_rng(0)
    schedule = [ScheduledConversation(f"c{i}", float(rng.uniform(0, 2)),
                                      tuple(ScheduledTurn(int(rng.integers(40, 200)), int(rng.integers(20, 120)), 0.0)
                                            for _ in range(4)))
                for i in range(12)]
    cache = PrefixCacheConfig(eviction, capacity, isolation=True, xi_tokens=150.0, q_hat=100.0,
                              capacity_counts=counts)
    built = build_engine(EngineConfig(runner="sim", model="vicuna-7b", hardware="a100-80g", policy="vllm",
                                      max_model_len=4096, prefix_cache=cache),
                         futures=conversation_futures(schedule))
    vocab = built.model_config.vocab_size
    records = run_conversations(built.engine, schedule, built.clock,
                                lambda cid, k, t: synthetic_message_ids(cid, k, t.new_tokens, vocab))
    cached = [r.record.num_cached_tokens for r in records]
    return cached, sum(cached) / sum(r.record.prompt_len for r in records)


@pytest.mark.parametrize("eviction", sorted(EVICTION_RULES))
def test_no_turn_reuses_more_than_the_capacity_allows(eviction: str) -> None:
    """The capacity binds at every step (the T-LRU paper's sum_i X_i <= C): a history a
    turn releases is trimmed before the next turn, waiting for it, is offered a hit, so
    no turn starts from more cached tokens than the capacity, whichever blocks it counts."""
    for counts in ("unreferenced", "all"):
        for capacity in (0, 256, 512):
            cached, _ = _served_from_cache(eviction, capacity, counts)
            assert max(cached) <= capacity, (counts, capacity)


@pytest.mark.parametrize("eviction", ["lru", "tlru"])
def test_the_share_served_from_cache_grows_with_the_capacity(eviction: str) -> None:
    shares = [_served_from_cache(eviction, capacity, "unreferenced")[1]
              for capacity in (0, 512, 1024, 2048, None)]
    assert shares[0] == 0.0 and shares[-1] > 0.3
    assert all(a <= b + 1e-9 for a, b in zip(shares, shares[1:])), shares
    assert shares[1] < shares[-1], shares
