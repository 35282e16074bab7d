"""What a request tells of its output length comes before any prediction
(`jserve.engine.admission.known_prediction`): `max_tokens` caps every prediction, and with
EOS ignored and no stop condition a `max_tokens` that fits is the length itself. Fixed-length
traces (`fixed:IN:OUT`) send it that way; open traces still tell nothing."""

from __future__ import annotations

import numpy as np
import pytest

from jserve import builder
from jserve.benchmarking.replay import replay
from jserve.benchmarking.workload import build_trace, load_trace, save_trace
from jserve.config import EngineConfig
from jserve.engine.admission import known_prediction, output_length_known
from jserve.engine.plan import Plan
from jserve.engine.sampling_params import SamplingParams
from jserve.engine.state import EngineState
from jserve.engine.view import SchedulerLimits, SchedulerView


def params(max_tokens: int, ignore_eos: bool = True, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, **kw)


def test_ignore_eos_with_a_fitting_max_tokens_is_the_length() -> None:
    # 100-token prompt, cap 612 (= 100 + 512): exactly 512 tokens, whatever was predicted
    assert known_prediction(params(512), 100, 612, 50, -1) == (512, 0, True)
    assert known_prediction(params(512), 100, 612, 0, 0) == (512, 0, True)


def test_max_tokens_caps_a_prediction_it_does_not_fix() -> None:
    # EOS can end it (not ignored), a stop id or string can: capped at 300, not known
    for p in (params(300, ignore_eos=False), params(300, stop_token_ids=[7]), params(300, stop=["x"])):
        assert not output_length_known(p, 100, 400)
        assert known_prediction(p, 100, 400, 550, 1) == (300, 1, False)
        assert known_prediction(p, 100, 400, 200, -1) == (200, -1, False)
        assert known_prediction(p, 100, 400, 0, 0) == (0, 0, False)  # no prediction stays none


def test_a_bound_past_the_context_tells_only_the_context() -> None:
    # `max_tokens` = the context (what a client that sets no bound gets): the cap (the
    # context, 512) ends the request, not max_tokens; a prediction is capped by the room
    p = params(512)
    assert not output_length_known(p, 100, 512)
    assert known_prediction(p, 100, 512, 550, 1) == (412, 1, False)
    assert known_prediction(p, 100, 512, 150, 1) == (150, 1, False)


class Spy:
    """Keeps, per step, each request's prediction columns as the policy sees them."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.chunked_prefill = inner, inner.name, inner.chunked_prefill
        self.capabilities = inner.capabilities
        self.seen: dict[int, tuple[int, bool]] = {}

    def schedule(self, view: SchedulerView) -> Plan:
        r = view.requests
        self.seen.update(zip(r.seq_id.tolist(), zip(r.predicted_len.tolist(), r.length_known.tolist())))
        return self.inner.schedule(view)


def seen(policy: str, workload: str) -> tuple[dict[int, tuple[int, bool]], list]:
    config = EngineConfig(runner="sim", policy=policy, model="opt-13b", hardware="a100-80g",
                          num_blocks=200, max_model_len=1024, max_num_seqs=16, cost_model="roofline")
    built = builder.build_engine(config)
    spy = Spy(built.engine.policy)
    built.engine.policy = spy
    trace = build_trace(workload, 12, 20.0, seed=3, max_total_len=1024)
    predictions = {r.request_id: (50, -1) for r in trace.requests}  # a predictor far too low
    records = replay(built.engine, trace, built.clock, lambda r: [0] * r.prompt_len, predictions=predictions)
    return spy.seen, records


@pytest.mark.parametrize("policy", ["layerkv", "cacheopt", "rlp", "s3"])
def test_fixed_length_traces_tell_every_prediction_based_policy(policy: str) -> None:
    fixed, records = seen(policy, "fixed:200:300")
    assert set(fixed.values()) == {(300, True)}
    assert {r.output_len for r in records} == {300}
    # ShareGPT's lengths are the model's: the prediction stays the predictor's
    open_, records = seen(policy, "sharegpt")
    assert set(open_.values()) == {(50, False)}
    assert len(records) == 12


def test_fixed_output_travels_with_the_trace(tmp_path) -> None:
    fixed = build_trace("fixed:64:32", 3, 1.0)
    assert all(r.fixed_output for r in fixed.requests)
    assert not any(r.fixed_output for r in build_trace("alpaca", 3, 1.0).requests)
    assert all(r.fixed_output for r in build_trace("alpaca", 3, 1.0, output_len=16).requests)
    save_trace(fixed, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == fixed
    assert np.all([r.output_len == 32 for r in fixed.requests])


class CountingSource:
    """A prediction source that predicts 40 tokens over, recording each call's request ids."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def predict(self, requests) -> list[tuple[int, int]]:
        self.calls.append([r.request_id for r in requests])
        return [(40, 1)] * len(requests)


def test_the_state_asks_its_prediction_source_once_per_arrival_at_the_next_snapshot() -> None:
    source = CountingSource()
    state = EngineState(num_blocks=64, block_size=4, limits=SchedulerLimits(4, 64, 64),
                        eos_token_id=None, vocab_size=100, predictions=source)
    open_ = SamplingParams(max_tokens=30)  # EOS allowed: the length is open, capped at 30
    state.add("open", [1, 2, 3], open_, 0.0)
    state.add("given", [1, 2, 3], open_, 0.0, predicted_len=7, predicted_dir=-1)  # the caller's
    state.add("known", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), 0.0)
    state.add("gone", [1, 2, 3], open_, 0.0)
    state.abort("gone", 0.0)
    view = state.snapshot(0.0)
    assert source.calls == [["open"]]  # one batch of the step's arrivals; nothing asked twice
    r = view.requests
    assert list(zip(r.predicted_len.tolist(), r.predicted_dir.tolist(), r.length_known.tolist())) == [
        (30, 1, False), (7, -1, False), (5, 0, True)]  # max_tokens caps the source's 40
    state.snapshot(0.0)
    assert source.calls == [["open"]]
