"""Repeated decode steps (`Plan.repeat`) change nothing but the Python per step.

A trace replayed in the simulator with repeats (each request ended where the trace ends it,
by `TraceEnds`) must give exactly what it gives one
`step()` at a time, and both what the engine gives when its policy plans every step (not
only where its plan stops repeating): every request's tokens, token times, first-token and finish times,
preemptions, the engine's totals, the clock and the blocks each request ended up with.
Traces are random (hypothesis), with caches tight enough that a repeat meets the point
where the free blocks run out and the policy preempts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jserve.benchmarking.replay import replay
from jserve.benchmarking.workload import Trace, TraceRequest
from jserve.builder import build_engine
from jserve.config import EngineConfig
from jserve.engine.batch import Batch, StepOutput
from jserve.engine.plan import Plan
from jserve.engine.sampling_params import SamplingParams
from jserve.errors import PlanError
from jserve.runners.cost_model import StepShape
from jserve.runners.sim_runner import SimRunner


class OneStepAtATime:
    """The simulator's runner without `repeat_decodes`: the engine runs every step alone."""

    def __init__(self, runner: SimRunner) -> None:
        self.runner = runner
        self.needs_inputs = runner.needs_inputs

    def execute(self, batch: Batch) -> StepOutput:
        return self.runner.execute(batch)


def _trace(seed: int, n: int, rate: float) -> Trace:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    reqs = tuple(
        TraceRequest(f"r{i}", float(t), int(rng.integers(1, 200)), int(rng.integers(1, 150)))
        for i, t in enumerate(np.cumsum(gaps)))
    return Trace("random", reqs, seed, rate, 1.0)


def _run(policy: str, trace: Trace, num_blocks: int, repeats: bool, ask_every_step: bool = False):
    """`repeats`: the simulator runs a repeating plan's steps at once; `ask_every_step`:
    the policy plans every step, where the engine would apply a repeating plan's later
    steps itself (`EngineState.apply_repeat`)."""
    built = build_engine(EngineConfig(runner="sim", policy=policy, model="opt-13b",
                                      hardware="a100-80g", num_blocks=num_blocks,
                                      max_model_len=512, max_num_seqs=16, swap_space=0.3))
    engine = built.engine
    if not repeats:
        engine.runner = OneStepAtATime(engine.runner)
    if ask_every_step:
        engine.state.apply_repeat = lambda now: None
    records = replay(engine, trace, built.clock, lambda r: [7] * r.prompt_len)
    return sorted(records, key=lambda r: r.request_id), engine.stats, built.clock.now()


@pytest.mark.parametrize("policy", ["vllm", "vllm-swap"])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), rate=st.sampled_from([2.0, 20.0, 200.0]),
       num_blocks=st.sampled_from([40, 96, 4096]))
def test_repeats_replay_exactly_like_single_steps(policy: str, seed: int, rate: float,
                                                  num_blocks: int) -> None:
    trace = _trace(seed, 40, rate)
    asked = _run(policy, trace, num_blocks, repeats=False, ask_every_step=True)
    one = _run(policy, trace, num_blocks, repeats=False)
    many = _run(policy, trace, num_blocks, repeats=True)
    assert one == asked
    assert many == asked


def test_repeats_save_steps_of_python() -> None:
    """A light load repeats most decode steps (the reason the fast path exists)."""
    trace = _trace(3, 40, 2.0)
    built = build_engine(EngineConfig(runner="sim", policy="vllm", model="opt-13b",
                                      hardware="a100-80g", num_blocks=4096))
    calls = 0
    step = built.engine.step

    def counting(until=None):
        nonlocal calls
        calls += 1
        return step(until)

    built.engine.step = counting
    replay(built.engine, trace, built.clock, lambda r: [7] * r.prompt_len)
    assert calls * 5 < built.engine.stats.num_steps


def test_shape_one_token_on_matches_its_lens() -> None:
    start = np.array([5, 17, 300])
    shape = StepShape.from_lens(start, np.ones(3))
    assert shape.one_token_on() == StepShape.from_lens(start + 1, np.ones(3))
    padded = dataclasses.replace(shape, padded_tokens=8, page_walk=8 * 300)
    assert padded.one_token_on().page_walk == 8 * 301
    with pytest.raises(ValueError, match="plain decodes"):
        StepShape.from_lens([4], [3]).one_token_on()


def test_only_plain_decode_plans_repeat() -> None:
    built = build_engine(EngineConfig(runner="sim", model="opt-13b", hardware="a100-80g",
                                      num_blocks=64))
    engine = built.engine
    engine.add_request("a", [7] * 20, SamplingParams(max_tokens=50, ignore_eos=True))
    seq = next(iter(engine.state.requests))
    with pytest.raises(PlanError, match="only one-token decodes"):
        engine.state.apply(Plan(run={seq: 20}, allocate={seq: 2}, repeat=3), 0.0)
    with pytest.raises(PlanError, match="at least once"):
        engine.state.apply(Plan(run={seq: 20}, allocate={seq: 2}, repeat=0), 0.0)


def test_the_engine_applies_a_repeat_until_a_request_arrives_or_ends() -> None:
    """A repeating plan's later steps are applied without the policy
    (`EngineState.apply_repeat`) while requests wait (decodes only take blocks, so the
    promise covers them), and no longer once a request arrives or is aborted."""
    built = build_engine(EngineConfig(runner="sim", model="opt-13b", hardware="a100-80g",
                                      num_blocks=64, max_num_seqs=2))
    engine = built.engine
    for i in range(3):  # the third waits: two sequences at most
        engine.add_request(f"r{i}", [7] * 20, SamplingParams(max_tokens=40, ignore_eos=True))
    repeated = []
    apply_repeat = engine.state.apply_repeat

    def recorded(now: float) -> Plan | None:
        plan = apply_repeat(now)
        repeated.append(plan is not None)
        return plan

    engine.state.apply_repeat = recorded
    for _ in range(4):  # the prompts, the policy's decode plan, two repeats of it
        engine.step()
    engine.add_request("r3", [7] * 20, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # the policy again: an arrival
    engine.step()  # a repeat of its plan
    engine.abort("r0")
    engine.step()  # the policy again: an abort
    assert repeated == [False, False, True, True, False, True, False]
